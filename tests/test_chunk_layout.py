"""Chunk files of format 4 stack alike layers into one tensor per part ("0-1.k.0"),
so that a small (quantized) cache is not read, checked and joined tensor by tensor;
files of format 3 (a tensor per layer) saved before still reopen, bit for bit, also
beside format 4 ones in one conversation; a stacked file that lies about its layers
is refused and the turn recomputes, losing nothing."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from tampering import as_format_3, rewrite_chunk
from test_cache_files import fresh_reply, new_engine, turn
from test_families import assert_identical

from app.engine.conversation import TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from sessions.cachefiles import CacheIndex, path_from_url, tensor_names
from sessions.chunkio import file_format
from sessions.db import open_db

TEXTS = (
    "a message long enough to fill several chunks of sixteen tokens, and then some more",
    "and a second one after it",
)
SCHEMES = {"16-bit": None, "8-bit": 8, "4-bit": 4}


def options(bits: int | None) -> TurnOptions:
    return TurnOptions(sampling=SamplingSettings.greedy(10), kv=KVSettings(bits, 32))


def saved(loaded, bits: int | None) -> int:
    engine = new_engine(loaded)
    conversation = engine.store.create(loaded.name)
    for text in TEXTS:
        turn(engine, conversation.id, text, options(bits))
    return conversation.id


def restored(loaded, conversation_id: int) -> list:
    engine = new_engine(loaded)
    entry = engine.index.conversation(conversation_id)
    result = engine.kvstore.restore(entry, len(entry.tokens))
    assert result.rejected is None and result.tokens == entry.tokens
    return result.cache


@pytest.mark.parametrize("bits", SCHEMES.values(), ids=SCHEMES.keys())
def test_a_chunk_file_holds_one_tensor_per_part_for_all_its_layers(tiny_model, bits):
    conversation_id = saved(tiny_model, bits)
    index = CacheIndex(open_db())
    parts = {"k.0", "v.0"} if bits is None else {f"{p}.{n}" for p in "kv" for n in range(3)}
    for key in index.conversation(conversation_id).chunk_keys:
        names = tensor_names(path_from_url(index.chunk(key)["url"]))
        assert {name.partition(".")[0] for name in names} == {"0-1"}  # both layers
        assert parts <= {name.partition(".")[2] for name in names}


@pytest.mark.parametrize("bits", SCHEMES.values(), ids=SCHEMES.keys())
def test_a_save_that_copies_each_tensor_first_writes_the_same_bytes(tiny_model, bits, monkeypatch):
    """Where the GPU has memory of its own, a save copies each tensor on the device
    before the host reads it (`stored_arrays.to_numpy`: a view would take its layer's
    whole buffer into managed memory). That path, run here on the CPU, writes the very
    bytes the direct one does."""
    from app.engine import codecs, stored_arrays

    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, TEXTS[0], options(bits))
    cache, end = engine.session.cache, len(engine.session.tokens)
    direct = codecs.chunk_tensors(cache, 3, end - 2)
    monkeypatch.setattr(stored_arrays, "device_apart", lambda: True)
    copied = codecs.chunk_tensors(cache, 3, end - 2)
    assert direct.keys() == copied.keys() and direct
    for name, array in direct.items():
        assert array.dtype == copied[name].dtype and np.array_equal(array, copied[name])


@pytest.mark.parametrize("bits", SCHEMES.values(), ids=SCHEMES.keys())
@pytest.mark.parametrize("old", ["every chunk", "the first chunks"])
def test_chunk_files_of_format_3_still_reopen_bit_for_bit(tiny_model, bits, old):
    conversation_id = saved(tiny_model, bits)
    from_format_4 = restored(tiny_model, conversation_id)
    index = CacheIndex(open_db())
    keys = index.conversation(conversation_id).chunk_keys
    assert len(keys) > 3
    for key in keys if old == "every chunk" else keys[:2]:
        as_format_3(index, key)
        assert file_format(path_from_url(index.chunk(key)["url"])) == "3"

    assert_identical(restored(tiny_model, conversation_id), from_format_4)
    engine = new_engine(tiny_model)
    saved_tokens = engine.index.conversation(conversation_id).tokens
    finished, _ = turn(engine, conversation_id, "and once more", options(bits))
    assert finished.restore.source == "disk"
    assert finished.stats.reused_tokens == len(saved_tokens)
    assert finished.text == fresh_reply(
        tiny_model, engine, conversation_id, options(bits), known=saved_tokens
    )


def _renamed(tensors: dict, _metadata: dict, span: str) -> None:
    for name in list(tensors):
        part = name.partition(".")[2]
        array = tensors.pop(name)
        tensors[f"{span}.{part}"] = np.concatenate([array, array[-1:]]) if span == "0-2" else array


def _one_more_run(tensors: dict, _metadata: dict) -> None:
    for name in list(tensors):
        tensors[f"1-1.{name.partition('.')[2]}"] = tensors[name][1:]


def _first_layer_only(tensors: dict, _metadata: dict) -> None:
    for name in list(tensors):
        tensors[f"0-0.{name.partition('.')[2]}"] = tensors.pop(name)[:1]


def _short_run(tensors: dict, _metadata: dict) -> None:
    keys = next(name for name in tensors if name.endswith(".k.0"))
    tensors[keys] = tensors[keys][:1]


def _beside_format_3(tensors: dict, _metadata: dict) -> None:
    keys = next(name for name in tensors if name.endswith(".k.0"))
    tensors["0.k.0"] = tensors[keys][0]


def _unlike_classes(_tensors: dict, metadata: dict) -> None:
    metadata["classes"] = json.dumps(["KVCache", "MixedKVCache"])


def _sixteen_bits_of_two_types(tensors: dict, _metadata: dict) -> None:
    """The sink (4-bit) or the values (16-bit) as bfloat16's raw bits, the rest float16:
    each type alone is one a save writes, the two together are not."""
    name = next((n for n in tensors if n.endswith(".sv")), None)
    name = name or next(n for n in tensors if n.endswith(".v.0"))
    tensors[name] = tensors[name].view(np.uint16)


# (what is changed, in which chunk, the reason the restore gives)
LIES = {
    "layers past the model's": (lambda t, m: _renamed(t, m, "0-2"), 1, "unexpected tensor '0-2."),
    "a number written oddly": (lambda t, m: _renamed(t, m, "0-01"), 1, "unexpected tensor '0-01."),
    "a layer in two runs": (_one_more_run, 1, "layers 1-1 are in two runs"),
    "a layer in no run": (_first_layer_only, 1, "layer 1 has the wrong tensors"),
    "a run shorter than its layers": (_short_run, 1, "k.0 has the wrong shape (1,"),
    "a format 3 tensor beside its run": (_beside_format_3, 1, "layers 0-0 are in two runs"),
    # In the first chunk: the next ones would disagree with its classes.
    "a run of unlike layers": (_unlike_classes, 0, "layers 0-1 are not alike"),
    "16 bits of two types": (_sixteen_bits_of_two_types, 0, "16-bit tensors are of different"),
}


@pytest.mark.parametrize("bits", [None, 4], ids=["16-bit", "4-bit"])
@pytest.mark.parametrize("lie", LIES.values(), ids=LIES.keys())
def test_a_file_that_lies_about_its_layers_is_refused_and_the_turn_recomputes(
    tiny_model, bits, lie
):
    change, chunk, reason = lie
    conversation_id = saved(tiny_model, bits)
    index = CacheIndex(open_db())
    rewrite_chunk(index, index.conversation(conversation_id).chunk_keys[chunk], change)

    engine = new_engine(tiny_model)
    finished, _ = turn(engine, conversation_id, "are you still there", options(bits))
    assert finished.restore.source == "recompute"
    assert reason in finished.restore.rejected
    assert finished.text == fresh_reply(tiny_model, engine, conversation_id, options(bits))
    assert len(engine.store.get(conversation_id).messages) == 2 * len(TEXTS) + 2


def _copy_name(tensors: dict) -> str:
    return next(name for name in tensors if name.partition(".")[2].startswith("r"))


def _copy_reaching_back(tensors: dict, _metadata: dict) -> None:
    """A copy claiming positions from 0: more rows than a layer ever holds in 16 bits."""
    name = _copy_name(tensors)
    array = tensors.pop(name)
    end = name.rpartition("-")[2][:-1]
    span, _, part = name.partition(".")
    tensors[f"{span}.r0-{end}{part[-1]}"] = np.concatenate([array] * 8, axis=3)[..., : int(end), :]


def _copy_short_of_its_name(tensors: dict, _metadata: dict) -> None:
    name = _copy_name(tensors)
    tensors[name] = tensors[name][..., 1:, :]


def _copy_of_another_chunk(tensors: dict, _metadata: dict) -> None:
    name = _copy_name(tensors)
    end = name.rpartition("-")[2][:-1]
    tensors[name.replace(f"-{end}", f"-{int(end) + 1}")] = tensors.pop(name)


COPY_LIES = {
    "a copy reaching back past the tail": (_copy_reaching_back, "has the wrong tensors"),
    "a copy shorter than its name": (_copy_short_of_its_name, "has the wrong shape"),
    "a copy ending past its chunk": (_copy_of_another_chunk, "has the wrong tensors"),
}


@pytest.mark.parametrize("lie", COPY_LIES.values(), ids=COPY_LIES.keys())
def test_a_16_bit_copy_that_does_not_fit_its_chunk_is_refused(tiny_model, lie):
    change, reason = lie
    conversation_id = saved(tiny_model, 4)
    index = CacheIndex(open_db())
    rewrite_chunk(index, index.conversation(conversation_id).chunk_keys[-1], change)

    engine = new_engine(tiny_model)
    finished, _ = turn(engine, conversation_id, "are you still there", options(4))
    assert finished.restore.source == "recompute"
    assert reason in finished.restore.rejected
    assert finished.text == fresh_reply(tiny_model, engine, conversation_id, options(4))


def test_a_restored_layer_takes_the_next_tokens_into_its_own_buffer(tiny_model):
    """Each restored layer holds a buffer of its own with room after its tokens (the
    CPU path's 16 bits, its tokens all in the bulk), so the next turn's tokens are
    written in place: layers sharing one buffer of the run would each be copied whole
    by the first token, before the reopened reply could start."""
    cache = restored(tiny_model, saved(tiny_model, None))

    def addresses() -> list[int]:
        buffers = [store.buffers[0] for layer in cache for store in layer.bulk]
        mx.eval(buffers)
        return [np.asarray(buffer).ctypes.data for buffer in buffers]

    before = addresses()
    for layer in cache:
        _, heads, _, width = layer.bulk[0].buffers[0].shape
        row = mx.ones((1, heads, 1, width), mx.float32)
        layer.update_and_fetch(row, row)
    assert addresses() == before
