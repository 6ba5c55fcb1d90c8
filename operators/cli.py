"""``pretrain-pipeline``: the console script (``[project.scripts]`` in pyproject.toml).

    pretrain-pipeline compare EXPERIMENT [...]
    pretrain-pipeline check FILE [...]

Each subcommand is a module named in ``SUBCOMMANDS`` that provides ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Those modules keep heavy imports (mlflow,
matplotlib, Airflow) inside ``run``, so ``--help`` stays fast; adding a subcommand is one line
here.
"""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS: dict[str, str] = {
    "compare": "operators.compare",
    "check": "operators.campaign.dag.check",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain-pipeline", description="Tools for pre-training campaigns tracked in MLflow.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=module.HELP, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
