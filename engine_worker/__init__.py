"""The Kaiten engine: paged KV cache, continuous batching, and the offline API."""
from engine_worker.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from engine_worker.engine.offline import LLM, Completion
from engine_worker.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Completion", "LLMEngine", "EngineStats", "RequestOutput",
           "SamplingParams"]
