"""Control messages in the engine loop: LoRA adapters loaded and unloaded at run time (the engine's
``add_lora`` / ``remove_lora``), and what the heartbeat announces of them: the adapters this
engine holds (``adapters``, name -> path) and the outcome of each recent operation
(``control_results``, op id -> [status, message]; 200 and "" for success, vLLM's status codes
otherwise), by which a gateway answers ``/v1/load_lora_adapter``."""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from shared.protocol import Control

log = logging.getLogger("kaiten.worker")

RESULTS_KEPT = 32            # outcomes announced; a gateway waits seconds for one, never longer


class Controls:
    def __init__(self, engine: Any):
        self.engine = engine
        self.results: OrderedDict[str, list] = OrderedDict()
        self._announced: dict | None = None

    def apply(self, controls: list[Control]) -> None:
        for c in controls:
            status, message = self._run(c)
            (log.info if status == 200 else log.warning)("%s %r: %s", c.op, c.lora_name, message or "done")
            self.results[c.op_id] = [status, message]
            while len(self.results) > RESULTS_KEPT:
                self.results.popitem(last=False)
        self._announced = None

    def _run(self, c: Control) -> tuple[int, str]:
        try:
            if c.op == "unload_lora":
                if not self.engine.remove_lora(c.lora_name):
                    return 404, f"The lora adapter '{c.lora_name}' cannot be found."
                return 200, ""
            if c.lora_name in self.adapters():
                return 400, f"The lora adapter '{c.lora_name}' has already been loaded."
            self.engine.add_lora(c.lora_name, c.lora_path)
            return 200, ""
        except (ValueError, OSError) as e:
            return 400, f"cannot load the lora adapter '{c.lora_name}' from {c.lora_path!r}: {e}"
        except Exception as e:     # a bug must not stop the loop: say what happened
            log.exception("%s %r", c.op, c.lora_name)
            return 500, f"{c.op} {c.lora_name!r} failed: {type(e).__name__}: {e}"

    def adapters(self) -> dict[str, str]:
        return dict(self.engine.lora_adapters())

    def announce(self) -> dict[str, Any]:
        """The heartbeat's fields (rebuilt only after an operation)."""
        if self._announced is None:
            self._announced = {"adapters": self.adapters(), "control_results": dict(self.results)}
        return self._announced
