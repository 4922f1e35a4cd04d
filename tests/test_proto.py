"""The committed stubs are what proto/generate.py makes from the .proto today."""

from __future__ import annotations

from pathlib import Path

from pdserve.proto import generate as gen


def test_committed_stubs_are_fresh(tmp_path: Path):
    fresh = gen.generate(tmp_path)
    assert fresh, "generate() wrote nothing"
    for path in fresh:
        committed = gen.PROTO_ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run `python proto/generate.py`"
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python proto/generate.py` and commit the result"
        )


def test_stubs_import_from_the_repository_root():
    from pdserve.proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert {s for s in pdserve_pb2.DESCRIPTOR.services_by_name} == {"Generation", "Worker", "Registry"}
    assert hasattr(pdserve_pb2_grpc, "GenerationStub")
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[-1, 5]))
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == [-1, 5]
    assert not request.sampling.HasField("temperature")  # unset: the engine default applies
