# Refuse secrets kept in plain text in the files Ansible loaded for a host (inventory, group_vars,
# host_vars): only ansible-vault (an encrypted file or an inline !vault value) and the environment count.
# Runs on the controller before any connection; messages name the variable and the file, never the value.
from __future__ import annotations

import os
import re
import shlex

import yaml
from ansible.errors import AnsibleError
from ansible.parsing.vault import is_encrypted
from ansible.plugins.action import ActionBase

# Names that hold secrets wherever they appear: vault_* (the convention of vault.yml) and *_password,
# *_secret (proxmox_api_password, proxmox_api_token_secret, proxmox_lxc_password, ansible_become_password).
SECRET_NAME = re.compile(r"^vault_|(^|_)(password|passwd|secret)$")
VAULT_FILE = re.compile(r"^vault(\.ya?ml|\.json)?$")


class _Vaulted:
    """An inline `!vault` value: encrypted, so never a plain secret."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!vault", lambda loader, node: _Vaulted())
_Loader.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))


def _is_plain(value) -> bool:
    """A literal secret: a non-empty string that is neither vaulted nor a template (a reference)."""
    return isinstance(value, str) and bool(value.strip()) and "{{" not in value and "{%" not in value


def _leaves(data, path=()):
    """(key path, value) of every scalar in a parsed vars file or YAML inventory."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _leaves(value, (*path, str(i)))
    else:
        yield path, data


def _ini_leaves(text):
    """key=value pairs of an INI inventory ([group:vars] sections and host lines)."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for token in tokens:
            key, sep, value = token.partition("=")
            if sep:
                yield (key.strip(),), value


def parse(path):
    """(encrypted, leaves) of a file as Ansible would read it."""
    with open(path, "rb") as fh:
        data = fh.read()
    if is_encrypted(data):
        return True, []
    text = data.decode("utf-8", "replace")
    try:
        parsed = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        parsed = None
    if isinstance(parsed, dict):
        return False, list(_leaves(parsed))
    return False, list(_ini_leaves(text))


def _shown(path):
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def env_name(var, env_vars):
    return env_vars.get(var) or env_vars.get(re.sub(r"^vault_", "", var)) or ""


def fix_for(var, path, env_vars):
    shown = _shown(path)
    vault = os.path.join(os.path.dirname(shown), "vault.yml")
    env = env_name(var, env_vars)
    return (f"move it into {vault} and run `ansible-vault encrypt {vault}`, or replace the value with the "
            f"output of `ansible-vault encrypt_string --name {var}`"
            + (f", or delete it and export {env} instead" if env else ""))


def find_problems(files, effective, env_vars):
    """Problems (one sentence each) in the given files; `effective` maps secret variables to their values."""
    problems = []
    for path in files:
        encrypted, leaves = parse(path)
        if encrypted:
            continue
        shown = _shown(path)
        if VAULT_FILE.match(os.path.basename(path)):
            names = sorted({p[-1] for p, v in leaves if _is_plain(v)})
            if names:
                problems.append(f"{shown} is not encrypted, yet it holds {', '.join(names)}: run "
                                f"`ansible-vault encrypt {shown}` (then run with --ask-vault-pass or "
                                f"ANSIBLE_VAULT_PASSWORD_FILE)")
            continue
        for key_path, value in leaves:
            if not _is_plain(value):
                continue
            name = key_path[-1] if key_path else "?"
            if SECRET_NAME.search(name):
                problems.append(f"{name} is plain text in {shown}: {fix_for(name, path, env_vars)}")
                continue
            for var, secret in effective.items():
                if value == secret:
                    problems.append(f"{var} has the value of {'.'.join(key_path)}, which is plain text in "
                                    f"{shown}: {fix_for(var, path, env_vars)}")
    return problems


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True
    _VALID_ARGS = frozenset(("variables",))

    def var_files(self, task_vars):
        """Every file Ansible loads variables from for this host: inventory sources, group_vars, host_vars."""
        files, bases = [], []
        for source in task_vars.get("ansible_inventory_sources") or []:
            source = os.path.abspath(os.path.expanduser(str(source)))
            if os.path.isfile(source):
                files.append(source)
                bases.append(os.path.dirname(source))
            elif os.path.isdir(source):
                bases.append(source)
                files += [os.path.join(source, f) for f in sorted(os.listdir(source))
                          if os.path.isfile(os.path.join(source, f)) and not f.startswith(".")]
        if task_vars.get("playbook_dir"):
            bases.append(str(task_vars["playbook_dir"]))
        groups = ["all", *(task_vars.get("group_names") or [])]
        for base in dict.fromkeys(bases):
            for group in groups:
                files += self._loader.find_vars_files(os.path.join(base, "group_vars"), group)
            files += self._loader.find_vars_files(os.path.join(base, "host_vars"), task_vars["inventory_hostname"])
        return list(dict.fromkeys(files))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        env_vars = dict(self._task.args.get("variables") or {})
        effective = {}
        for var in env_vars:
            if var not in task_vars:
                continue
            try:
                value = self._templar.template(task_vars[var])
            except AnsibleError:
                value = None  # an unresolvable reference: whoever uses the variable reports it
            if _is_plain(value):
                effective[var] = str(value)
        files = self.var_files(task_vars)
        problems = find_problems(files, effective, env_vars)
        result.update(changed=False, checked_files=[_shown(f) for f in files])
        if problems:
            result.update(failed=True, problems=problems, msg=(
                "Secrets come from ansible-vault or the environment, never from plain files; nothing was changed.\n"
                + "\n".join(f"- {p}" for p in problems)))
        return result
