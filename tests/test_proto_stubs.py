"""The checked-in gRPC stubs must match proto/: regenerate them and compare byte for byte."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
        cwd=ROOT, check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [str(p) for p in generated if (ROOT / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"stale stubs (run `make proto`): {stale}"
