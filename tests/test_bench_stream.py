"""stream.py's probe selection: the kernels, tile rows and programs a GPU call times, refused by name when unknown."""
import pytest

import stream


def test_probe_selection_parses():
    args = stream.parse_args(["--probe-only", "--probe-kernels", "gluon,gluon-fp8", "--probe-rows", "32,64",
                              "--probe-programs", "33"])
    assert args.probe_kernels == ["gluon", "gluon-fp8"] and args.probe_rows == [32, 64] and args.probe_programs == 33
    default = stream.parse_args([])
    assert default.probe_kernels == list(stream.PROBE_KERNELS) and default.probe_rows == [32, 64, 128]
    assert default.probe_programs == 0         # every SM


@pytest.mark.parametrize("flag, value, named", [("--probe-kernels", "gluon,fp4", "fp4"),
                                                ("--probe-rows", "48", "48"), ("--probe-rows", "sixty", "sixty"),
                                                ("--probe-programs", "-1", "-1")])
def test_probe_selection_refuses_what_it_cannot_run(flag, value, named, capsys):
    with pytest.raises(SystemExit):
        stream.parse_args([flag, value])
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("programs, rows, kernels, named", [(32, 32, ["gluon"], "at least 128 programs"),
                                                             (65, 64, ["gluon-fp8"], "128-row blocks"),
                                                             (65, 64, ["gluon"], None),
                                                             (33, 128, ["gluon-fp8", "gluon-fp8-2wg"], None)])
def test_probe_shapes_it_cannot_stack_are_named(programs, rows, kernels, named):
    """Each probe layer reads the one before's outputs as its inputs, and e4m3 scales come a 128-row block: a grid
    too small for that is refused before any GPU work, by name."""
    problem = stream.probe_shape_problem(programs, [rows], kernels)
    assert (problem is None) if named is None else (named in problem and f"--probe-rows {rows}" in problem)
