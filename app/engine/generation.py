"""Settings, events and per-turn statistics of generation, as plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from app.engine.kvscheme import GROUP_SIZES, PREFERENCE_BITS


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.7
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 1024
    seed: int | None = None

    @classmethod
    def greedy(cls, max_tokens: int = 256) -> SamplingSettings:
        return cls(temperature=0.0, top_p=1.0, max_tokens=max_tokens, seed=0)


@dataclass(frozen=True)
class KVSettings:
    """mlx-lm's KV quantization knobs: None bits keeps the cache in full precision."""

    bits: int | None = None
    group_size: int = 64
    quantized_kv_start: int = 0

    def __post_init__(self) -> None:
        if self.bits is not None and self.bits not in PREFERENCE_BITS:
            raise ValueError(f"KV bits must be one of {PREFERENCE_BITS} or None, not {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"KV group size must be one of {GROUP_SIZES}, not {self.group_size}")

    def describe(self) -> str:
        if self.bits is None:
            return "16-bit"
        return f"{self.bits}-bit (group {self.group_size}, after {self.quantized_kv_start} tokens)"


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class PromptProgress:
    done: int
    total: int


@dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int = 0  # tokens of the rendered conversation fed this turn
    reused_tokens: int = 0  # of which were already in the KV cache
    prefilled_tokens: int = 0  # of which the model actually processed this turn
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # turn start to first generated token
    generated_tokens: int = 0
    decode_s: float = 0.0
    kv_bytes: int = 0
    kv_format: str = "16-bit"
    peak_memory_bytes: int = 0
    finish_reason: str = ""  # "stop", "length", "cancelled"
    compute: str = ""

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["prefill_tps"] = round(self.prefill_tps, 2)
        data["decode_tps"] = round(self.decode_tps, 2)
        return data


@dataclass(frozen=True)
class TurnFinished:
    text: str
    stats: TurnStats
