"""What a quantized KV cache stores, as plain data: `KVScheme`, its format
string (what a saved cache records and needs to be used again), and the
schemes the Memory preference's 8-bit and 4-bit stand for."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVScheme:
    """How a KV cache stores its tokens. None bits keep that half in float16."""

    key_bits: int | None
    value_bits: int | None
    group_size: int = 64
    sink: int = 0
    window: int = 0
    rotate_keys: bool = False

    def __post_init__(self) -> None:
        for bits in (self.key_bits, self.value_bits):
            if bits not in (None, 2, 3, 4, 5, 6, 8):
                raise ValueError(f"KV bits must be 2-6, 8 or None, not {bits}")

    @property
    def format(self) -> str:
        """What a saved cache needs to be used again ("k4v4g64s4h"); the float16
        window is not saved (it comes back quantized), so it is not part of it."""
        kb, vb = self.key_bits or 16, self.value_bits or 16
        text = f"k{kb}v{vb}g{self.group_size}"
        return text + (f"s{self.sink}" if self.sink else "") + ("h" if self.rotate_keys else "")

    def describe(self) -> str:
        """ "4-bit (group 64, 16-bit first 4 + last 64 tokens, rotated keys)"."""
        if self.key_bits is None and self.value_bits is None:
            return "16-bit"
        kb, vb = self.key_bits or 16, self.value_bits or 16
        text = f"{kb}-bit" if kb == vb else f"{kb}-bit keys, {vb}-bit values"
        extras = [f"group {self.group_size}"]
        if self.sink:
            extras.append(f"16-bit first {self.sink} + last {self.window} tokens")
        elif self.window:
            extras.append(f"16-bit last {self.window} tokens")
        if self.rotate_keys:
            extras.append("rotated keys")
        return f"{text} ({', '.join(extras)})"

    def bits_per_value(self) -> float:
        """Average stored bits per key or value element, scales and biases included."""

        def one(bits: int | None) -> float:
            return 16.0 if bits is None else bits + 32 / self.group_size

        return (one(self.key_bits) + one(self.value_bits)) / 2


SIXTEEN_BIT = KVScheme(None, None)
# What the Memory preference's "8-bit" and "4-bit" mean, chosen from `reprise bench kv`
# (see the README's table): group size 64, replaced by the preference's.
APP_SCHEMES = {
    "8-bit": KVScheme(8, 8, 64, sink=4, window=64),
    "4-bit": KVScheme(4, 4, 64, sink=4, window=128, rotate_keys=True),
}
# The bit widths the Memory preference offers, and the group sizes it can use.
PREFERENCE_BITS = tuple(int(label.split("-")[0]) for label in APP_SCHEMES)
GROUP_SIZES = (32, 64, 128)


def scheme_for(bits: int | None, group_size: int = 64) -> KVScheme | None:
    """The scheme the KV preference names (the app's 8-bit or 4-bit); None keeps the
    cache in the model's precision."""
    if bits is None:
        return None
    return replace(APP_SCHEMES[f"{bits}-bit"], group_size=group_size)


def usable_format(stored: str, wanted: KVScheme | None) -> bool:
    """Whether a cache stored as `stored` (saved, or in memory) can serve the `wanted`
    scheme: a full-precision one always can (quantizing it is lossless with respect
    to a fresh run), the CPU path's float16 (`SIXTEEN_BIT`) any of ours, a quantized
    one only the same scheme."""
    if stored in ("float32", "float16", "bfloat16"):
        return True
    return wanted is not None and stored in (wanted.format, SIXTEEN_BIT.format)


def parse_format(text: str) -> KVScheme:
    """The scheme a saved format names (window 0: saved caches hold none)."""
    match = re.fullmatch(r"k(\d+)v(\d+)g(\d+)(?:s(\d+))?(h?)", text)
    if not match:
        raise ValueError(f"not a KV scheme format: {text!r}")
    kb, vb, group, sink, rotate = match.groups()
    return KVScheme(
        None if kb == "16" else int(kb),
        None if vb == "16" else int(vb),
        int(group),
        int(sink or 0),
        0,
        bool(rotate),
    )
