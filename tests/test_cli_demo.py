"""What ``python -m dpfast demo`` says about itself: its help describes the examples it runs, and the seeds' own
errors (from their reports, with the seeds' batch sizes) are shown as quotes, not as this run's output."""

from __future__ import annotations

import pytest

import dpfast.__main__ as cli
from dpfast.__main__ import EXAMPLES, load_example


def _demo_parser_texts() -> tuple[str, str]:
    """(the demo command's line in ``python -m dpfast --help``, ``python -m dpfast demo --help``)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    listing = next(a.help for a in sub._choices_actions if a.dest == "demo")
    return listing, sub.choices["demo"].format_help()


def test_demo_help_counts_the_examples_it_runs():
    listing, _ = _demo_parser_texts()
    assert "two seed models" not in listing
    assert f"the {len(EXAMPLES)} examples" in listing


def test_demo_help_names_each_example_and_what_each_prints():
    _, help_text = _demo_parser_texts()
    flat = " ".join(help_text.split())
    for name, _ in EXAMPLES:
        assert f"{name}.py" in flat
    # rrn_fused_state.py needs no spec at all, so it has no ScatterError to show: the help must not promise one
    assert "Each prints the ScatterError" not in flat


@pytest.mark.parametrize(
    "name,seed_batch", [("rrn", "batch of 10,000 on 4 GPUs"), ("transformer", "(3225, 3225) mask on 6 GPUs")]
)
def test_demo_quotes_the_seed_error_as_a_quote(name, seed_batch, capsys):
    module = load_example(name)
    assert module.main(["--devices", "cpu:2", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if module.SEED_ERROR in line)
    context = " ".join(lines[max(0, at - 1) : at + 1])
    assert "quoted from the seed's report" in context and seed_batch in context, context
    assert any("dpfast raises" in line for line in lines[at:]), "this run's own error must follow the quote"
