"""Convert EasyR1's geo3k example scripts into vlgrpo recipes with `vlgrpo from-easyr1`'s mapping.

    python scripts/convert_easyr1_examples.py --easyr1 PATH [--rev REV]

PATH is an EasyR1 checkout (a work tree, or a bare git directory read at REV, HEAD by default). Each
script's overrides (the arguments of its `python3 -m verl.trainer.main`, shell variables filled in)
go on top of its examples/config.yaml: examples/qwen2_5_vl_7b_geo3k_{grpo,gspo,cispo,sapo,dapo,reinforce}.sh
become configs/easyr1/<script>.yaml, and examples/qwen2_5_vl_3b_geo3k_grpo.sh (EasyR1's defaults for
the task vlgrpo's 3B recipe runs) becomes configs/easyr1_geo3k_default.yaml. Each file's header names
the EasyR1 commit; its lines name the EasyR1 keys they come from.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

import yaml

from vlgrpo.from_easyr1 import convert, render

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {f"examples/qwen2_5_vl_7b_geo3k_{name}.sh": ROOT / "configs" / "easyr1" / f"qwen2_5_vl_7b_geo3k_{name}.yaml"
           for name in ("grpo", "gspo", "cispo", "sapo", "dapo", "reinforce")}
SCRIPTS["examples/qwen2_5_vl_3b_geo3k_grpo.sh"] = ROOT / "configs" / "easyr1_geo3k_default.yaml"
EXTRA = {"examples/qwen2_5_vl_3b_geo3k_grpo.sh": ["trainer.experiment_name=easyr1_geo3k_default"]}


class Checkout:
    """Files of an EasyR1 checkout: a work tree, or a bare git directory at a revision."""

    def __init__(self, path: Path, rev: str):
        self.path, self.rev = path, rev
        self.work_tree = (path / "examples" / "config.yaml").is_file()
        self.commit = self._git("rev-parse", "HEAD" if self.work_tree else rev).strip()

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.path), *args], check=True, capture_output=True, text=True).stdout

    def read(self, name: str) -> str:
        return (self.path / name).read_text() if self.work_tree else self._git("show", f"{self.rev}:{name}")


def script_overrides(text: str) -> list[str]:
    """The key=value arguments of the script's `python3 -m verl.trainer.main`, its shell variables filled in."""
    text = text.replace("\\\n", " ")
    variables = dict(re.findall(r"^([A-Z_][A-Z0-9_]*)=(\S+)", text, flags=re.MULTILINE))
    (command,) = [line for line in text.splitlines() if "verl.trainer.main" in line]
    args = shlex.split(command, comments=True)
    args = args[args.index("verl.trainer.main") + 1 :]
    return [re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables[m.group(1)], a) for a in args]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--easyr1", required=True, type=Path, help="an EasyR1 checkout (work tree or bare git directory)")
    parser.add_argument("--rev", default="HEAD", help="the revision of a bare git directory")
    args = parser.parse_args(argv)
    easyr1 = Checkout(args.easyr1, args.rev)
    base = yaml.safe_load(easyr1.read("examples/config.yaml"))
    for script, out in SCRIPTS.items():
        overrides = [o for o in script_overrides(easyr1.read(script)) if not o.startswith("config=")] + EXTRA.get(script, [])
        recipe, entries = convert(base, overrides)
        header = [f"EasyR1 (hiyouga/EasyR1, commit {easyr1.commit[:12]}) {script} converted by vlgrpo from-easyr1:",
                  f"examples/config.yaml with the script's overrides: {' '.join(overrides)}",
                  "Regenerate: python scripts/convert_easyr1_examples.py --easyr1 <EasyR1 checkout>",
                  "Each value names the EasyR1 key it comes from; keys without a vlgrpo key are listed at the end",
                  "(docs/from-easyr1.md).",
                  f"  snakemake --cores all --configfile {out.relative_to(ROOT)}", ""]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render(recipe, entries, header))
        print(f"{script} -> {out.relative_to(ROOT)}: {sum(bool(e.problem) for e in entries)} not supported")


if __name__ == "__main__":
    main()
