"""repro.perf.compiled_buffers: the buffers of one compiled step, read off inductor's generated code."""

from __future__ import annotations

import json
import re

import pytest

from repro.perf.compiled_buffers import buffers, main

WRAPPER = """# AOT ID: ['0_backward']
        buf3 = empty_strided_cpu((8, 64, 1), (64, 1, 512), torch.float32)
        buf4 = empty_strided_cpu((64, ), (1, ), torch.bfloat16)
        cpp_fused_layer_norm_backward_1(buf1, buf3)
        buf18 = buf4; del buf4  # reuse
        buf19 = reinterpret_tensor(buf18, (8, 8), (8, 1), 0); del buf18  # reuse
        extern_kernels.mm(primals_2, view_3, out=buf19)
"""


def test_buffers_are_parsed_with_their_bytes_and_first_writer_through_aliases():
    first, second = buffers(WRAPPER)
    assert (first.graph, first.shape, first.dtype, first.nbytes, first.writer) == \
        ("0_backward", (8, 64, 1), "float32", 8 * 64 * 4, "cpp_fused_layer_norm_backward_1")
    assert (second.shape, second.nbytes, second.writer) == ((64,), 128, "extern_kernels.mm")


def test_tiny_step_has_its_logits_once_and_no_float32_logit_buffer_in_backward(tmp_path):
    """The tiny headline step compiled on CPU: forward and backward graphs; the bf16 logits are the one
    logit-sized buffer (the matmul's output); the backward allocates none (the cross-entropy backward
    and the padded-vocab mask fuse into passes over existing buffers: docs/training.md)."""
    assert main(["--out", str(tmp_path), "--tiny"]) == 0
    result = json.loads((tmp_path / "buffers.json").read_text())
    # AOT IDs count compiles in the process that first compiled a graph: one read back from inductor's
    # cache keeps its old number (17_forward after other compiles), so only the kinds are fixed
    forward, backward = sorted(result["totals_bytes"], key=lambda graph: not graph.endswith("_forward"))
    assert re.fullmatch(r"\d+_forward", forward) and re.fullmatch(r"\d+_backward", backward), result["totals_bytes"]
    logit_sized = [(g["graph"], g["dtype"], g["writer"], g["count"]) for g in result["groups"] if g["logit_sized"]]
    assert logit_sized == [(forward, "bfloat16", "extern_kernels.mm", 1)], logit_sized
    assert f"| {forward} |" in (tmp_path / "buffers.md").read_text()


@pytest.mark.parametrize("argv, needle", [(["--layers", "0"], "at least 1"), (["--batch", "0"], "at least 1")])
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "o"), "--tiny", *argv])
    assert exit_info.value.code != 0 and needle in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
