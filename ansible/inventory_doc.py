"""Write the example inventory's group_vars/all/proxmox.yml from the roles' meta/argument_specs.yml.

Every setting of every role appears, in playbook order, with its description from the argument specs and
its default from the role's defaults/main.yml. The file's own (uncommented) values are the example's
choices and are kept; everything else is generated, so it cannot fall behind the roles.

    python ansible/inventory_doc.py            # rewrite inventory/example/group_vars/all/proxmox.yml
    python ansible/inventory_doc.py --check    # exit 1 (and say so) when it is not current
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROLES_DIR = HERE / "roles"
EXAMPLE = HERE.parent / "inventory" / "example" / "group_vars" / "all" / "proxmox.yml"
# The roles whose settings an inventory holds, in the order the playbooks use them.
ROLES = ("proxmox", "proxmox_template", "proxmox_lxc", "proxmox_gpu", "nvidia_userspace", "training",
         "training_venv", "training_run")
WIDTH = 110
HEADER = """\
---
# Every setting of `make provision` and `make deploy` / `make train`, with its meaning and default.
# Lines starting with `# name:` show a default: uncomment one to change it. Lines without `#` are this
# example's choices. Override per node in group_vars/<node>/, per container in hosts.yml.
# Generated from the roles' meta/argument_specs.yml and defaults/main.yml by `make inventory-doc`, which
# keeps the values set here: edit the values here, the descriptions in the argument specs.
"""


class DocError(ValueError):
    pass


@functools.cache
def load_yaml(path: Path):
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def role_options(role: str) -> dict[str, dict]:
    """Every option of every entry point of a role, the first description winning."""
    specs = (load_yaml(ROLES_DIR / role / "meta" / "argument_specs.yml") or {}).get("argument_specs", {})
    options: dict[str, dict] = {}
    for entry in sorted(specs, key=lambda e: e != "main"):
        for name, spec in (specs[entry].get("options") or {}).items():
            options.setdefault(name, spec)
    return options


def role_defaults(role: str) -> dict:
    return load_yaml(ROLES_DIR / role / "defaults" / "main.yml") or {}


def owner(name: str, defaults: dict[str, dict]) -> str:
    """The role that documents a setting: the one whose defaults define it, else the longest role-name prefix."""
    for role in ROLES:
        if name in defaults[role]:
            return role
    prefixed = [r for r in ROLES if name.startswith(r + "_")]
    if not prefixed:
        raise DocError(f"{name} is in an argument spec, but no role defines it or carries its prefix")
    return max(prefixed, key=len)


def settings() -> list[tuple[str, str, list[tuple[str, dict, object, bool]]]]:
    """[(role, its short description, [(name, spec, default, has_default)])] in documentation order."""
    defaults = {role: role_defaults(role) for role in ROLES}
    by_role: dict[str, list] = {role: [] for role in ROLES}
    seen = set()
    for role in ROLES:
        for name, spec in role_options(role).items():
            if name in seen:
                continue
            seen.add(name)
            home = owner(name, defaults)
            spec = role_options(home).get(name, spec)
            by_role[home].append((name, spec, defaults[home].get(name), name in defaults[home]))
    out = []
    for role in ROLES:  # described by its main entry point, or (a role of task files only) by its meta/main.yml
        specs = (load_yaml(ROLES_DIR / role / "meta" / "argument_specs.yml") or {}).get("argument_specs", {})
        meta = load_yaml(ROLES_DIR / role / "meta" / "main.yml") or {}
        about = specs.get("main", {}).get("short_description") or meta.get("galaxy_info", {}).get("description", "")
        out.append((role, about, by_role[role]))
    return out


class Vaulted(str):
    """An inline `!vault |` value (ansible-vault encrypt_string): kept as its ciphertext and written back tagged."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!vault", lambda loader, node: Vaulted(loader.construct_scalar(node)))


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value):
    # Templates and strings with quotes read best double-quoted, as the roles' defaults write them.
    style = '"' if ("{{" in value or "'" in value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(Vaulted, lambda dumper, value: dumper.represent_scalar("!vault", value, style="|"))


def read_values(text: str) -> dict:
    """The file's uncommented settings; a clear DocError when it is not a mapping of setting: value."""
    values = yaml.load(text, Loader=_Loader)  # a SafeLoader that also keeps !vault values
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise DocError(f"its top level is a {type(values).__name__}, not a mapping of setting: value "
                       f"(group_vars files hold `name: value` lines); fix the file or point INVENTORY_DOC at another")
    return values


def dump(name: str, value) -> list[str]:
    """`name: value` as YAML: block style at the top, flow style for lists and mappings of scalars."""
    flow = None if isinstance(value, (list, dict)) else False
    text = yaml.dump({name: value}, Dumper=_Dumper, sort_keys=False, default_flow_style=flow, width=10**6,
                     allow_unicode=True)
    return text.rstrip("\n").splitlines()


def comment(text: str, indent: str = "# ") -> list[str]:
    return textwrap.wrap(" ".join(text.split()), WIDTH - len(indent), initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False)


def describe(spec: dict) -> list[str]:
    desc = spec.get("description", "")
    paragraphs = desc if isinstance(desc, list) else [desc]
    lines = [line for p in paragraphs for line in comment(str(p))]
    if spec.get("choices"):
        lines += comment("One of: " + ", ".join(str(c) for c in spec["choices"]) + ".")
    return lines


def render(values: dict) -> str:
    """The whole file: every setting, `values` (the example's choices) uncommented."""
    known = set()
    lines = HEADER.splitlines()
    for role, short, options in settings():
        if not options:
            continue
        title = f"# --- {role}: {short} (ansible/roles/{role}) "
        lines += ["", title + "-" * max(3, WIDTH - len(title))]
        for name, spec, default, has_default in options:
            known.add(name)
            lines.append("")
            lines += describe(spec)
            if name in values:
                lines += dump(name, values[name])
            elif has_default:
                lines += ["# " + line for line in dump(name, default)]
            else:
                required = "required, no default" if spec.get("required") else "no default"
                lines.append(f"# {name}:   ({required})")
    unknown = sorted(set(values) - known)
    if unknown:
        raise DocError(f"{', '.join(unknown)}: not a setting of any role (a typo, or a setting the roles no "
                       f"longer read); fix the file or the argument specs")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python ansible/inventory_doc.py", description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", type=Path, default=EXAMPLE)
    ap.add_argument("--check", action="store_true", help="only say whether the file is current")
    args = ap.parse_args(argv)
    try:
        current = args.file.read_text() if args.file.is_file() else ""
    except (OSError, UnicodeDecodeError) as exc:
        print(f"inventory-doc: cannot read {args.file}: {exc}; fix its permissions or point INVENTORY_DOC at another",
              file=sys.stderr)
        return 2
    try:
        wanted = render(read_values(current))
    except (DocError, yaml.YAMLError) as exc:
        print(f"inventory-doc: {args.file}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if current != wanted:
            print(f"inventory-doc: {args.file} is not current with the roles' argument specs: run make inventory-doc",
                  file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        try:
            args.file.write_text(wanted)
        except OSError as exc:
            print(f"inventory-doc: cannot write {args.file}: {exc.strerror or exc}; create its folder "
                  f"({args.file.parent}) or point INVENTORY_DOC at a file in an existing one", file=sys.stderr)
            return 2
        print(f"inventory-doc: wrote {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
