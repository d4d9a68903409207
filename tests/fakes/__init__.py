"""The test fakes, one definition each: scripted LLMs (`llm`) and the domains' scripted policies
and models over them (`math`, `agent`, `dser`, `coder`), a counting sandbox (`sandbox`), and
the scripted coder pipeline's code location (`coder_location`). Test modules import them from
here and never from one another."""
