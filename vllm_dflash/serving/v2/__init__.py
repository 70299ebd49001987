"""Our DFlash speculator for vLLM's model runner V2 (the GPU default)."""
