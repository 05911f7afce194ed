"""Pure-Python engine core: request state, KV block manager, scheduler. Imports no torch."""
