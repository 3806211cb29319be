"""`kvscope serve MODEL` (vLLM's positional form) means `--model MODEL`; two different
models are refused before anything loads; data-parallel replicas get --model, never the
positional."""

from __future__ import annotations

import pytest

from kvscope.engine.cli import build_parser, main
from kvscope.engine.commands.serve import model_of
from kvscope.engine.router.data_parallel import replica_argv


@pytest.mark.parametrize(("argv", "model"), [(["serve"], "smollm2"),
                                             (["serve", "dummy:tiny"], "dummy:tiny"),
                                             (["serve", "--model", "dummy:tiny"], "dummy:tiny"),
                                             (["serve", "x", "--model", "x"], "x")])
def test_the_model_comes_from_either_form(argv, model):
    assert model_of(build_parser().parse_args(argv)) == model


def test_two_different_models_are_refused(capsys):
    assert main(["serve", "dummy:tiny", "--model", "smollm2"]) == 2
    assert "two models" in capsys.readouterr().err


def test_replicas_get_the_model_as_a_flag():
    args = build_parser().parse_args(["serve", "dummy:tiny", "--data-parallel-size", "2",
                                      "--max-num-seqs", "4"])
    args.model = model_of(args)
    argv = replica_argv(args)
    assert "--model-tag" not in argv and argv[argv.index("--model") + 1] == "dummy:tiny"
    again = build_parser().parse_args(argv[3:])  # after "python -m engine.cli"
    assert model_of(again) == "dummy:tiny" and again.max_num_seqs == 4


def test_auto_tool_choice_needs_a_parser_and_replicas_get_both_flags(capsys):
    assert main(["serve", "dummy:tiny", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "dummy:tiny", "--data-parallel-size", "2",
                                      "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"])
    args.model = model_of(args)
    again = build_parser().parse_args(replica_argv(args)[3:])
    assert again.enable_auto_tool_choice and again.tool_call_parser == "hermes"


def test_a_chat_template_that_is_no_file_or_does_not_compile_is_refused(capsys, tmp_path):
    assert main(["serve", "dummy:tiny", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["serve", "dummy:tiny", "--chat-template", "{% for %}"]) == 2
    assert "does not compile" in capsys.readouterr().err
