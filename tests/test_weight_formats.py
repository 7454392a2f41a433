"""The weight-update formats of slime_dsa.weights, on CPU: our safetensors_b64 encoding, the bodies of SGLang's
weight endpoints (field names checked against SGLang's io_struct.py), and the cuda_ipc JSON handle table
(encoding, checks, error messages). The transports that use them are tested in test_weight_sync.py."""

from __future__ import annotations

import base64
import json
import pickle

import pytest
import torch

from slime_dsa.weights import WeightFormatError
from slime_dsa.weights.cuda_ipc import (ALIGN_BYTES, IpcBuffer, IpcFormatError, IpcTensor, IpcWeights, layout,
                                        open_buffer, views)
from slime_dsa.weights.payloads import (TensorSpec, bucket_specs, init_weights_update_group_payload,
                                        update_weights_from_disk_payload, update_weights_from_distributed_payload)
from slime_dsa.weights.safetensors_b64 import (LOAD_FORMAT, decode_named_tensors, encode_named_tensors,
                                               tensor_update_payloads)

# ---- safetensors_b64 ----------------------------------------------------------------------------------------


def test_named_tensors_round_trip_through_base64_safetensors():
    embed = torch.randn(4, 3)
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "b": torch.arange(5, dtype=torch.bfloat16)}
    decoded = decode_named_tensors(encode_named_tensors(tensors))  # tied weights (shared storage) are fine
    assert set(decoded) == set(tensors)
    for name, t in tensors.items():
        assert decoded[name].dtype == t.dtype and torch.equal(decoded[name], t)


@pytest.mark.parametrize("entry, message", [
    (7, "serialized_named_tensors[0] must be a base64 string, got int"),
    ("%%%", "serialized_named_tensors[0] is not valid base64"),
    (base64.b64encode(pickle.dumps({"w": torch.zeros(1)})).decode(), "is never unpickled"),
    (base64.b64encode(b"not safetensors at all").decode(), "serialized_named_tensors[0] is not safetensors bytes"),
])
def test_decode_refuses_what_is_not_safetensors_naming_the_entry(entry, message):
    with pytest.raises(WeightFormatError) as err:
        decode_named_tensors(entry)
    assert message in str(err.value)


def test_safetensors_header_length_ending_in_0x80_is_not_taken_for_a_pickle():
    """The low byte of a safetensors header length can be 0x80, the pickle PROTO opcode: still safetensors."""
    from safetensors.torch import save

    for length in range(1, 200):
        data = save({"w" * length: torch.zeros(1)})
        if data[0] == 0x80:
            break
    else:
        raise AssertionError("no tensor name gave a header length ending in 0x80")
    assert set(decode_named_tensors(base64.b64encode(data).decode())) == {"w" * length}


def test_tensor_update_payloads_set_the_version_once_with_the_last_bucket():
    state = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    payloads = tensor_update_payloads(state, weight_version="3", bucket_bytes=1000)
    assert len(payloads) == 3
    assert [p["weight_version"] for p in payloads] == [None, None, "3"]
    assert [p["flush_cache"] for p in payloads] == [False, False, True]
    assert all(p["load_format"] == LOAD_FORMAT and len(p["serialized_named_tensors"]) == 1 for p in payloads)
    buckets = [decode_named_tensors(p["serialized_named_tensors"][0]) for p in payloads]
    assert [set(b) for b in buckets] == [{"t0", "t1"}, {"t2", "t3"}, {"t4"}]  # consecutive tensors, in order
    assert all(torch.equal(b[k], state[k]) for b in buckets for k in b)


# ---- SGLang's weight endpoints --------------------------------------------------------------------------------


def test_weight_update_payloads_use_sglang_field_names():
    specs = [TensorSpec("model.embed_tokens.weight", "bfloat16", (4, 2)), TensorSpec("lm_head.weight", "float32", (4, 2))]
    init = init_weights_update_group_payload("10.0.0.1", 29500, rank_offset=1, world_size=9)
    assert init == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 9,
                    "group_name": "weight_update_group", "backend": "nccl"}
    dist = update_weights_from_distributed_payload(specs, weight_version="7")
    assert dist == {"names": ["model.embed_tokens.weight", "lm_head.weight"], "dtypes": ["bfloat16", "float32"],
                    "shapes": [[4, 2], [4, 2]], "group_name": "weight_update_group", "flush_cache": True,
                    "abort_all_requests": False, "weight_version": "7"}
    assert update_weights_from_disk_payload("/ckpt/step_7", weight_version="7") == {
        "model_path": "/ckpt/step_7", "load_format": None, "abort_all_requests": False, "weight_version": "7"}


def test_bucket_specs_keeps_the_order_and_a_large_tensor_alone():
    specs = [TensorSpec("a", "float32", (10,)), TensorSpec("b", "bfloat16", (10,)), TensorSpec("c", "float32", (100,)),
             TensorSpec("d", "float32", (1,))]
    assert [s.nbytes for s in specs] == [40, 20, 400, 4]
    assert [[s.name for s in b] for b in bucket_specs(specs, 64)] == [["a", "b"], ["c"], ["d"]]
    assert bucket_specs([], 64) == []


# ---- the cuda_ipc table ---------------------------------------------------------------------------------------

HANDLE = b"\x01" * 64
REF = b"/torch_123_456_7"


def ipc_table(**buffer_overrides) -> dict:
    """A well-formed cuda_ipc entry of three tensors (its handles open nothing), with buffer fields overridden."""
    tensors, nbytes = layout([("a.weight", (3, 5), "bfloat16"), ("b.weight", (7,), "float32"), ("c", (), "int64")])
    buffer = IpcBuffer("GPU-1234", HANDLE, nbytes, 4096, nbytes, REF, 3, b"\x02" * 64, True)
    table = IpcWeights(buffer, tensors).to_json()
    table["buffer"].update(buffer_overrides)
    return table


def test_layout_aligns_every_slice():
    tensors, nbytes = layout([("a", (3, 5), "bfloat16"), ("b", (7,), "float32"), ("c", (0,), "float32"), ("d", (), "int64")])
    assert [t.offset for t in tensors] == [0, ALIGN_BYTES, 2 * ALIGN_BYTES, 2 * ALIGN_BYTES]  # an empty tensor takes no room
    assert [t.nbytes for t in tensors] == [30, 28, 0, 8] and nbytes == 3 * ALIGN_BYTES


def test_table_round_trips_through_json():
    table = ipc_table()
    parsed = IpcWeights.from_json(json.loads(json.dumps(table)))
    assert parsed.to_json() == table
    assert parsed.buffer.handle == HANDLE and parsed.buffer.ref_counter_handle == REF
    assert parsed.tensors[0] == IpcTensor("a.weight", (3, 5), "bfloat16", 0)


def test_views_read_each_slice_with_its_dtype_and_shape():
    tensors, nbytes = layout([("a", (2, 3), "bfloat16"), ("b", (4,), "float32")])
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    out = views(flat, tensors)
    out["a"].copy_(torch.arange(6.0).view(2, 3))
    out["b"].copy_(torch.tensor([1.5, 2.5, 3.5, 4.5]))
    again = views(flat, tensors)
    assert torch.equal(again["a"], torch.arange(6.0, dtype=torch.bfloat16).view(2, 3))
    assert again["b"].tolist() == [1.5, 2.5, 3.5, 4.5]


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("buffer"), "serialized_named_tensors[0].buffer must be an object"),
    (lambda t: t.update(tensors=[]), "tensors must be a non-empty list"),
    (lambda t: t["buffer"].update(device_uuid=3), "buffer.device_uuid must be a non-empty string"),
    (lambda t: t["buffer"].update(handle="%%%"), "buffer.handle is not valid base64"),
    (lambda t: t["buffer"].update(handle=""), "buffer.handle must decode to 1..1024 bytes"),
    (lambda t: t["buffer"].update(storage_size_bytes=True), "buffer.storage_size_bytes must be an integer >= 1"),
    (lambda t: t["buffer"].update(storage_offset_bytes=-1), "buffer.storage_offset_bytes must be an integer >= 0"),
    (lambda t: t["buffer"].update(nbytes=10**9), "buffer.nbytes (1000000000) exceeds storage_size_bytes"),
    (lambda t: t["buffer"].update(ref_counter_handle=base64.b64encode(b"/etc/passwd").decode()),
     "buffer.ref_counter_handle must name a torch ref-counter file"),
    (lambda t: t["buffer"].update(ref_counter_offset=10000), "buffer.ref_counter_offset (10000) must be below 10000"),
    (lambda t: t["buffer"].update(event_sync_required="yes"), "buffer.event_sync_required must be true or false"),
    (lambda t: t["buffer"].update(event_handle=None), "buffer.event_handle is required"),
    (lambda t: t["tensors"][1].update(name=""), "tensors[1].name must be a non-empty string"),
    (lambda t: t["tensors"][1].update(shape=[7, -1]), "tensors[1] (b.weight).shape must be a list of non-negative"),
    (lambda t: t["tensors"][1].update(dtype="complex64"), "tensors[1] (b.weight).dtype must be one of"),
    (lambda t: t["tensors"][1].update(offset=258), "tensors[1] (b.weight).offset (258) is not a multiple of the float32"),
    (lambda t: t["tensors"][1].update(shape=[7000]), "tensors[1] (b.weight): offset + bytes (256 + 28000) exceeds"),
    (lambda t: t["tensors"][2].update(name="a.weight"), "tensors[2]: tensor a.weight appears twice"),
])
def test_malformed_tables_are_refused_naming_the_field(change, message):
    table = ipc_table()
    change(table)
    with pytest.raises(IpcFormatError) as err:
        IpcWeights.from_json(table)
    assert message in str(err.value)


def test_tables_are_checked_against_the_models_tensors():
    ipc = IpcWeights.from_json(ipc_table())
    ipc.check_against({"a.weight": (3, 5), "b.weight": (7,), "c": (), "other": (1,)})  # a partial set is fine
    with pytest.raises(IpcFormatError, match=r"tensor c: the model has no tensor of that name"):
        ipc.check_against({"a.weight": (3, 5), "b.weight": (7,)})
    with pytest.raises(IpcFormatError, match=r"tensor b.weight has shape \(7,\), the model expects \(8,\)"):
        ipc.check_against({"a.weight": (3, 5), "b.weight": (8,), "c": ()})


def test_float_spans_cover_every_float_slice_in_runs_of_one_dtype():
    """Neighbouring slices of one dtype are one span (the padding between them inside); a new dtype or an integer
    slice ends a run; every float slice's values are its span's, at the span's element grid."""
    from slime_dsa.weights.cuda_ipc import float_spans

    specs = [("a", (3, 5), "bfloat16"), ("b", (7,), "bfloat16"), ("r", (4, 2), "float32"), ("i", (3,), "int64"),
             ("c", (2,), "float32"), ("d", (0,), "bfloat16"), ("e", (9,), "bfloat16")]
    tensors, nbytes = layout(specs)
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    named = views(flat, tensors)
    for i, view in enumerate(named.values()):
        view.fill_(i + 1)
    spans = float_spans(flat, tensors)
    assert [(s.dtype, s.numel() * s.element_size()) for s in spans] == [
        (torch.bfloat16, ALIGN_BYTES + 14), (torch.float32, 32), (torch.float32, 8), (torch.bfloat16, 18)]
    for t in tensors:
        if named[t.name].is_floating_point() and named[t.name].numel():
            span = next(s for s in spans if s.data_ptr() <= flat.data_ptr() + t.offset < s.data_ptr() + s.nbytes)
            start = (flat.data_ptr() + t.offset - span.data_ptr()) // span.element_size()
            assert torch.equal(span[start:start + named[t.name].numel()], named[t.name].view(-1)), t.name
    # A table whose slices overlap (a receiver takes any valid one): a slice inside another leaves the run as long
    overlapping = [IpcTensor("big", (64,), "float32", 0), IpcTensor("inside", (4,), "float32", 16)]
    assert [s.numel() for s in float_spans(torch.zeros(256, dtype=torch.uint8), overlapping)] == [64]


def test_open_buffer_needs_a_cuda_engine():
    with pytest.raises(IpcFormatError, match="needs an engine on a CUDA device; this one runs on cpu"):
        open_buffer(IpcWeights.from_json(ipc_table()).buffer, torch.device("cpu"))


def test_the_update_check_names_the_first_tensor_that_is_not_finite():
    """check_update reads every tensor's finiteness with one host sync per device: the error still names the first
    bad tensor in the dict's order, and a finite dict passes."""
    import torch

    from slime_dsa.weights import WeightFormatError
    from slime_dsa.weights.checks import check_update

    params = {f"w{i}": torch.zeros(2, 3) for i in range(5)}
    update = {name: torch.ones(2, 3) for name in params}
    check_update(update, params)
    update["w3"][1, 2] = float("inf")
    update["w4"][0, 0] = float("nan")
    with pytest.raises(WeightFormatError, match="tensor w3 holds NaN or infinite values"):
        check_update(update, params)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_update_check_finds_a_bad_value_anywhere_across_dtypes_and_passes_huge_finite_ones(device):
    """The check's per-tensor largest |x| (one foreach call per dtype): a NaN or an infinity at any position of any
    tensor is found, the first bad tensor in the dict's order is named even when its dtype is checked later, and
    finite values at the dtype's limit, empty tensors and -0.0 pass."""
    import torch

    from slime_dsa.weights import WeightFormatError
    from slime_dsa.weights.checks import check_update

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    shapes = {"a": (3, 5), "b": (70_000,), "c": (0, 4), "d": (2, 2), "e": (129, 33)}
    dtypes = {"a": torch.bfloat16, "b": torch.float32, "c": torch.float32, "d": torch.float32, "e": torch.bfloat16}
    params = {n: torch.zeros(s, dtype=dtypes[n], device=device) for n, s in shapes.items()}
    update = {n: torch.full(s, -0.0, dtype=dtypes[n], device=device) for n, s in shapes.items()}
    update["a"][1, 1] = torch.finfo(torch.bfloat16).max
    update["b"][-1] = -torch.finfo(torch.float32).max
    check_update(update, params)
    for name, index in (("b", (69_999,)), ("b", (0,)), ("e", (128, 32)), ("a", (0, 0)), ("d", (1, 0))):
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = {n: t.clone() for n, t in update.items()}
            broken[name][index] = bad
            with pytest.raises(WeightFormatError, match=f"tensor {name} holds NaN"):
                check_update(broken, params)
    broken = {n: t.clone() for n, t in update.items()}
    broken["e"][0, 0] = float("nan")  # bf16, checked in the first dtype group
    broken["b"][5] = float("inf")  # float32, earlier in the dict: the one named
    with pytest.raises(WeightFormatError, match="tensor b holds NaN"):
        check_update(broken, params)
