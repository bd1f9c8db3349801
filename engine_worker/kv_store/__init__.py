"""The shared KV store on Redis (engine_worker/engine/kv_connector.py is the engine's interface)."""
