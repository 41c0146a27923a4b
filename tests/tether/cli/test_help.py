"""Every `tether` command's --help renders, and says what the code does.

For `tether` itself, each of its commands (tether/cli/main.py: COMMANDS, the services' through SERVICE_MODULES)
and each subcommand (`tether keys new`, `tether certs init`, ...): format_help() runs without an argparse
formatting error (a stray `%` in a help string, a `%(name)s` that names no field), every argument carries a help
text unless it is hidden (SUPPRESS), and that text, expanded, is in the rendered help. And `tether up --help`
states the layer split the code makes for smollm2 on 2 stages, the figures computed here from the model's config.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Iterator

import pytest

from tether.cli.main import COMMANDS, SERVICE_MODULES, build_parser
from tether.model.config import ModelConfig, balanced_split, head_cost
from tether.model.folder import resolve_model


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser `tether COMMAND ARGS` parses ARGS with: what tether/cli/main.py's main() dispatches to."""
    if command in SERVICE_MODULES:
        return importlib.import_module(f"services.{SERVICE_MODULES[command]}.main").build_parser()
    module_name = COMMANDS[command][1]
    assert module_name is not None, f"{command} is neither a service nor has a module"
    module = importlib.import_module(module_name)
    return module.build_tag_parser() if command == "tag" else module.build_parser()


def with_subcommands(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`parser` and, depth first, the parser of each of its subcommands, each with the command line that shows it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from with_subcommands(f"{name} {sub_name}", sub)


def every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    out = [("tether", build_parser())]
    for command in COMMANDS:
        out.extend(with_subcommands(f"tether {command}", command_parser(command)))
    return out


PARSERS = every_parser()


def squashed(text: str) -> str:
    """`text` without whitespace: the help formatter wraps lines (and breaks them after hyphens)."""
    return "".join(text.split())


def helped(action: argparse.Action) -> list[argparse.Action]:
    """The actions whose help text is `action`'s to render: a subcommand group's are its subcommands' lines,
    one for each subcommand (its aliases, the same parser under another name, share its line)."""
    if not isinstance(action, argparse._SubParsersAction):
        return [action]
    first_names, seen = [], set()
    for sub_name, sub in action.choices.items():
        if id(sub) not in seen:
            seen.add(id(sub))
            first_names.append(sub_name)
    lines = list(action._choices_actions)
    missing = set(first_names) - {line.dest for line in lines}
    assert not missing, f"subcommands without a help line: {sorted(missing)}"
    return lines


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """`action`'s help as the parser renders it: %(default)s and the like filled in, the formatter's additions
    (ArgumentDefaultsHelpFormatter's default) included."""
    return parser._get_formatter()._expand_help(action)


def test_every_command_has_a_parser_here():
    names = {name for name, _ in PARSERS}
    assert {f"tether {c}" for c in COMMANDS} <= names
    assert {"tether keys new", "tether keys hash", "tether certs init"} <= names


@pytest.mark.parametrize("name,parser", PARSERS, ids=[name for name, _ in PARSERS])
def test_help_renders_every_options_text(name, parser):
    text = parser.format_help()     # raises on a help string argparse cannot format (a stray %, an unknown field)
    parser.format_usage()
    rendered = squashed(text)
    assert "%(" not in text, f"{name}: an unexpanded %(...) in the help"
    shown = 0
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        for a in helped(action):
            label = "/".join(a.option_strings) or a.dest or a.metavar
            assert a.help and a.help.strip(), f"{name}: {label} has no help text"
            want = expanded_help(parser, a)
            assert squashed(want) in rendered, f"{name}: the help of {label} is not rendered: {want!r}"
            for option in a.option_strings:
                assert option in text, f"{name}: {option} is not in the help"
            shown += 1
    assert shown, f"{name}: no argument with help"


def test_up_stages_help_states_the_split_the_code_makes_for_smollm2():
    """The --stages help says "smollm2 on 2 stages: 17 + 13 of 30": the layers of the first and the last stage
    and the model's, as balanced_split (with the LM head's cost) makes them from the converted model's config."""
    parser = command_parser("up")
    [stages] = [a for a in parser._actions if "--stages" in a.option_strings]
    text = " ".join(expanded_help(parser, stages).split())
    assert squashed(text) in squashed(parser.format_help())
    stated = re.search(r"smollm2 on 2 stages: (\d+) \+ (\d+) of (\d+)", text)
    assert stated, f"--stages does not state the smollm2 split: {text!r}"

    cfg = ModelConfig.from_folder(resolve_model("smollm2"))
    split = balanced_split(cfg.num_hidden_layers, 2, head_cost(cfg))
    figures = [end - start for start, end in split] + [cfg.num_hidden_layers]
    assert [int(g) for g in stated.groups()] == figures, (
        f"`tether up --help` says smollm2 on 2 stages is {stated.group(1)} + {stated.group(2)} of "
        f"{stated.group(3)} layers; the code splits it {' + '.join(map(str, figures[:-1]))} of {figures[-1]}")
    assert f"smollm2 on 2 stages: {figures[0]} + {figures[1]} of {figures[2]}" in text
