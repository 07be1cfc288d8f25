"""The Debian base root filesystem, built reproducibly with mmdebstrap (no Docker Hub needed)."""

from __future__ import annotations

import argparse
import calendar
import hashlib
import json
import os
import sys
import time
import tomllib
from pathlib import Path

from dflash_image.commands import ToolError, find, run

CONFIG = Path(__file__).resolve().parent / "rootfs.toml"


def load_config(path: Path = CONFIG) -> dict:
    cfg = tomllib.loads(path.read_text())
    cfg["mirror"] = os.environ.get("DFLASH_DEBIAN_MIRROR") or cfg["mirror"].format(snapshot=cfg["snapshot"])
    return cfg


def source_date_epoch(cfg: dict) -> int:
    """The snapshot date as a Unix time: the clamp for every mtime in the rootfs and the template."""
    return calendar.timegm(time.strptime(cfg["snapshot"], "%Y%m%dT%H%M%SZ"))


def build(out_dir: Path, cfg: dict | None = None) -> Path:
    """mmdebstrap -> out_dir/debian-<release>-base-<inputs hash>.tar; reused when it already exists."""
    cfg = cfg or load_config()
    inputs = json.dumps({k: cfg[k] for k in ("suite", "mirror", "variant", "packages", "snapshot")}, sort_keys=True)
    out = out_dir / f"debian-{cfg['release']}-base-{hashlib.sha256(inputs.encode()).hexdigest()[:12]}.tar"
    if out.is_file():
        print(f"rootfs: reusing {out}", flush=True)
        return out
    mmdebstrap = find("mmdebstrap", "install it: apt-get install mmdebstrap")
    if os.geteuid() != 0:
        raise ToolError("building the rootfs needs root (mmdebstrap --mode=root keeps file ownership exact): run as root")
    out_dir.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(source_date_epoch(cfg))}
    try:
        run([mmdebstrap, f"--variant={cfg['variant']}", f"--include={','.join(cfg['packages'])}", "--mode=root",
             "--format=tar", "--aptopt=Acquire::Check-Valid-Until \"false\"", cfg["suite"], part, cfg["mirror"]],
            f"mmdebstrap {cfg['suite']} from {cfg['mirror']} (set DFLASH_DEBIAN_MIRROR if that mirror is unreachable)",
            env=env)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    part.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_image.rootfs", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("build/image"))
    args = ap.parse_args(argv)
    try:
        print(build(args.out))
    except ToolError as exc:
        print(f"rootfs: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
