"""Lathe's SDK types on their own and on the wire: round trips of every message, future results, tensor bytes,
Datum conversions (lists, numpy arrays, torch tensors), the model input and tinker path helpers. The clients
against a fake gateway: tests/test_sdk.py."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import Message

import lathe
from lathe import info_wire, wire
from lathe.v1 import lathe_pb2 as pb
from tests.fake_gateway import BASE
from tests.helpers import next_token_datum

RECEIPT = lathe.Receipt("req-1", "m:train:0", 4, 9, 120, 3, 0.25, 1.5, "bfloat16", "forward_backward")
WHEN = datetime(2025, 5, 6, 7, 8, 9, 500000, tzinfo=UTC)
ROUND_TRIPS = [
    (lathe.TensorData([1, 2, 3, 4, 5, 6], "int64", [2, 3]), wire.tensor_to_proto, wire.tensor_from_proto),
    (lathe.TensorData(np.array([0.5, -1.25], np.float32), "float32"), wire.tensor_to_proto, wire.tensor_from_proto),
    (lathe.TensorData([7, -8], "int32"), wire.tensor_to_proto, wire.tensor_from_proto),
    (lathe.ModelInput([lathe.EncodedTextChunk([1, 2]), lathe.EncodedTextChunk([3])]),
     wire.model_input_to_proto, wire.model_input_from_proto),
    (next_token_datum([5, 6, 7, 8]), wire.datum_to_proto, wire.datum_from_proto),
    (lathe.LoraConfig(), wire.lora_config_to_proto, wire.lora_config_from_proto),
    (lathe.LoraConfig(rank=4, seed=0, train_mlp=False, train_attn=True, train_unembed=False, alpha=8.0),
     wire.lora_config_to_proto, wire.lora_config_from_proto),
    (lathe.AdamParams(3e-4, 0.8, 0.99, 1e-8, 0.01, 1.0), wire.adam_params_to_proto, wire.adam_params_from_proto),
    (RECEIPT, wire.receipt_to_proto, wire.receipt_from_proto),
    (lathe.GetInfoResponse("m:train:0", lathe.ModelData(model_name=BASE, tokenizer_id="tok"),
                           lathe.LoraConfig(rank=16, seed=2), 4096),
     info_wire.get_info_to_proto, info_wire.get_info_from_proto),
    (lathe.GetServerCapabilitiesResponse([lathe.SupportedModel("a", 1), lathe.SupportedModel("b", 2)]),
     info_wire.capabilities_to_proto, info_wire.capabilities_from_proto),
    (lathe.Checkpoint("weights/x", "training", "tinker://r/weights/x", WHEN, 123, WHEN),
     info_wire.checkpoint_to_proto, info_wire.checkpoint_from_proto),
    (lathe.TrainingRun("r", BASE, lathe.LoraConfig(rank=2), WHEN, WHEN, {"k": "v"},
                       lathe.Checkpoint.from_tinker_path("tinker://r/weights/a"),
                       lathe.Checkpoint.from_tinker_path("tinker://r/sampler_weights/b")),
     info_wire.training_run_to_proto, info_wire.training_run_from_proto),
]


@pytest.mark.parametrize(("value", "to_proto", "from_proto"), ROUND_TRIPS,
                         ids=[type(v).__name__ for v, _, _ in ROUND_TRIPS])
def test_wire_round_trips(value: object, to_proto: Callable[[Any], Message], from_proto: Callable[[Any], object]
                          ) -> None:
    msg = to_proto(value)
    back = from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back == value


def test_optional_lora_fields_stay_unset() -> None:
    msg = wire.lora_config_to_proto(lathe.LoraConfig(rank=4))
    assert not msg.HasField("seed") and not msg.HasField("alpha")
    assert wire.lora_config_to_proto(lathe.LoraConfig(seed=0)).HasField("seed")


RESULTS = [
    lathe.ForwardBackwardOutput("ArrayRecord", [{"logprobs": lathe.TensorData([-0.5, -2.0], "float32", [2])}],
                                {"loss:sum": 2.5}, RECEIPT),
    lathe.OptimStepResponse({"grad_norm:mean": 0.5}, RECEIPT),
    lathe.SaveWeightsResponse("tinker://m/weights/a", RECEIPT),
    lathe.SaveWeightsForSamplerResponse("tinker://m/sampler_weights/a", None),
    lathe.LoadWeightsResponse("tinker://m/weights/a", "m", RECEIPT),
    lathe.CreateModelResponse("s:train:0"),
]


@pytest.mark.parametrize("value", RESULTS, ids=[type(v).__name__ for v in RESULTS])
def test_future_results_round_trip(value: object) -> None:
    res = pb.FutureResult.FromString(wire.result_to_proto(value, "req-9").SerializeToString())
    assert res.done and res.request_id == "req-9"
    assert wire.result_from_proto(res, type(value)) == value


def test_result_of_the_wrong_kind_is_an_internal_error() -> None:
    res = wire.result_to_proto(lathe.OptimStepResponse({}), "req-3")
    with pytest.raises(lathe.Internal, match="'optim_step' result; expected 'forward_backward'"):
        wire.result_from_proto(res, lathe.ForwardBackwardOutput)


def test_tensor_bytes_are_little_endian_raw_values() -> None:
    msg = wire.tensor_to_proto(lathe.TensorData([1, 256], "int32"))
    assert msg.data == b"\x01\x00\x00\x00\x00\x01\x00\x00" and list(msg.shape) == [2]
    with pytest.raises(lathe.InvalidArgument, match="7 bytes"):
        wire.tensor_from_proto(pb.Tensor(data=b"\x00" * 7, dtype="float32"))


def test_datum_converts_lists_by_key_like_tinker() -> None:
    d = lathe.Datum(model_input=lathe.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2.0, 3.0], "weights": [0, 1], "advantages": [True, False],
                                    "mask": [[1, 0], [0, 1]], "scale": [0.5, 2]})
    got = {k: (v.dtype, v.shape) for k, v in d.loss_fn_inputs.items()}
    assert got == {"target_tokens": ("int64", [2]), "weights": ("float32", [2]), "advantages": ("float32", [2]),
                   "mask": ("int64", [2, 2]), "scale": ("float32", [2])}
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3]
    assert d.loss_fn_inputs["mask"].to_numpy().tolist() == [[1, 0], [0, 1]]


def test_datum_converts_numpy_arrays_by_kind() -> None:
    d = lathe.Datum(model_input=lathe.ModelInput.from_ints([1]),
                    loss_fn_inputs={"target_tokens": np.array([[4, 5]], np.int32),
                                    "weights": np.array([0.25, 1.0]), "flags": np.array([True])})
    t = d.loss_fn_inputs["target_tokens"]
    assert (t.dtype, t.shape, t.to_numpy().dtype) == ("int64", [1, 2], np.int64)
    assert d.loss_fn_inputs["weights"].to_numpy().dtype == np.float32
    assert d.loss_fn_inputs["flags"].dtype == "int64"


def test_datum_converts_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    d = lathe.Datum(model_input=lathe.ModelInput.from_ints([1]),
                    loss_fn_inputs={"target_tokens": torch.tensor([[3, 4, 5]], dtype=torch.int32),
                                    "weights": torch.tensor([0.5, 1.0], dtype=torch.bfloat16, requires_grad=True)})
    t, w = d.loss_fn_inputs["target_tokens"], d.loss_fn_inputs["weights"]
    assert (t.dtype, t.shape, t.tolist()) == ("int64", [1, 3], [[3, 4, 5]])
    assert (w.dtype, w.tolist()) == ("float32", [0.5, 1.0])
    back = t.to_torch()
    assert back.dtype == torch.int64 and back.shape == (1, 3)
    assert lathe.TensorData.from_torch(back) == t


def test_bad_loss_inputs_are_refused_where_they_are_built() -> None:
    mi = lathe.ModelInput.from_ints([1])
    with pytest.raises(ValueError, match="rectangular"):
        lathe.Datum(model_input=mi, loss_fn_inputs={"weights": [[1.0], [1.0, 2.0]]})
    with pytest.raises(TypeError, match=r"loss_fn_inputs\['weights'\] is a str"):
        lathe.Datum(model_input=mi, loss_fn_inputs={"weights": "1.0"})
    with pytest.raises(ValueError, match="holds 6 values, but data has 5"):
        lathe.TensorData([1, 2, 3, 4, 5], "int64", [2, 3])
    with pytest.raises(ValueError, match="dtype = 'float64'"):
        lathe.TensorData([1.0], "float64")  # type: ignore[arg-type]


def test_model_input_helpers() -> None:
    mi = lathe.ModelInput.from_ints([1, 2]).append_int(3).append(lathe.EncodedTextChunk([4, 5]))
    assert mi.to_ints() == [1, 2, 3, 4, 5] and mi.length == 5 and len(mi.chunks) == 3
    assert lathe.ModelInput.empty().length == 0


def test_tinker_paths_parse() -> None:
    p = lathe.ParsedCheckpointTinkerPath.from_tinker_path("tinker://s:train:0/sampler_weights/final")
    assert (p.training_run_id, p.checkpoint_type, p.checkpoint_id) == ("s:train:0", "sampler", "sampler_weights/final")
    for bad in ("s/weights/x", "tinker://s/other/x", "tinker://s/weights/x/y", "tinker:///weights/x"):
        with pytest.raises(ValueError, match="invalid tinker path"):
            lathe.ParsedCheckpointTinkerPath.from_tinker_path(bad)
