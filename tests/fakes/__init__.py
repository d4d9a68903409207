"""The test fakes, one definition each: scripted LLMs (`llm`) and the domains' scripted policies
and models over them (`math`, `agent`, `dser`, `coder`), a counting sandbox (`sandbox`), the
scripted coder pipeline's code location (`coder_location`), and a scripted OpenAI-compatible
server on loopback (`openai_server`). Test modules import them from here and never from one
another."""
