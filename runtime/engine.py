"""The engine: schedule -> run -> postprocess, until every request has finished.

(Interface stub: the implementation lands with the scheduler and model runner.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from runtime.config import EngineConfig
from runtime.request import Completion, GenerationRequest


class Engine:
    """Built once per job from a frozen EngineConfig.

    Attributes the pipeline uses:
      tokenizer: a transformers tokenizer (chat_template set when the model has one)
      eos_token_ids: frozenset[int]
      max_model_len: int (prompt + completion tokens must fit)
      model_name: str (what config.model resolved to, for manifests)
    """

    def __init__(self, config: EngineConfig) -> None:
        raise NotImplementedError

    def generate(
        self,
        requests: Iterable[GenerationRequest],
        on_step: Callable[[int], None] | None = None,
    ) -> Iterator[Completion]:
        """Pull requests lazily from `requests` (only as many as fit the batch), yield each
        Completion as soon as it finishes (not in input order). on_step(n) is called after each
        engine step with the number of tokens generated in that step (for progress bars)."""
        raise NotImplementedError
