"""``enginecore proxy``: an OpenAI-compatible router for disaggregated prefill/decode
(vLLM's disagg proxy): prefill on one pool of servers, decode on another."""
