"""What tests share, one definition each, so that no test module imports another: the fakes
(scripted LLMs in `llm`; the domains' scripted policies and models over them in `math`, `agent`,
`dser` and `coder`; the scripted coder pipeline's code location in `coder_location`; a scripted
OpenAI-compatible server on loopback in `openai_server`; sandboxes in `sandbox`), the real
servers the scale-out tests start (`servers`), training jobs as the assets launch them
(`training`), and the repository's paths and commands (`repo`)."""
