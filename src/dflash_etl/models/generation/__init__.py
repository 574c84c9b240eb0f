"""Generation for the regenerate stage: the backends that write replies (a local model, offline
vLLM, a fleet of OpenAI-compatible servers), how a reply is judged, and the pure transform that
rewrites conversations with them. Nothing here reads or writes a run directory."""
