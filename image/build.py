"""`make image`: the training image (docker SDK, live build log), the Proxmox template, the OCI archive.

Steps: the Debian base (mmdebstrap, cached) is imported as an image; the Dockerfile builds the locked
venv on it with no network, from a context holding the lock, the wheelhouse, the trainer wheel and uv;
a container of the result is exported, scrubbed and packed reproducibly into
debian-13-dflash-trainenv_<ver>-<lock>_amd64.tar.zst (+ .sha256), and the same layer is wrapped as an
OCI archive. A manifest JSON ties them to the lock hash, the torch build and the base.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dflash_image import manifest, oci, pylock, rebuild, rootfs, template, wheelhouse
from dflash_image.commands import ToolError, uv
from dflash_image.digest import sha256_of

HERE = Path(__file__).resolve().parent
# What the build stage runs (`python3 -m dflash_image.rebuild` under the base's bare python3).
STAGE_MODULES = ("__init__.py", "digest.py", "manifest.py", "pylock.py", "rebuild.py")


class BuildError(ToolError):
    pass


def docker_client(base_url: str | None = None):
    import docker  # the control extra; only the build needs it

    url = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.DockerClient(base_url=url, timeout=600)
        client.ping()
    except Exception as exc:
        raise BuildError(f"no docker daemon at {url} ({exc.__class__.__name__}): start one (e.g. "
                         "`apt-get install docker.io && dockerd &`, or podman's `podman system service`) "
                         "or set DOCKER_HOST") from exc
    return client


def lock_digest(lock_dir: Path) -> str:
    """What the lock hash label means: uv.lock when present, else the exported pylock.toml."""
    for name in ("uv.lock", "pylock.toml"):
        if (lock_dir / name).is_file():
            return sha256_of(lock_dir / name)
    raise BuildError(f"no uv.lock or pylock.toml in {lock_dir}: run `make lock`")


def make_context(ctx: Path, lock_dir: Path, wheels: list[Path], trainer_wheel: Path, sde: int) -> None:
    shutil.copy2(HERE / "Dockerfile", ctx / "Dockerfile")
    shutil.copy2(HERE / "profile.sh", ctx / "profile.sh")
    c = ctx / "context"
    for sub in ("dflash_image", "lock", "wheelhouse", "trainer", "bin"):
        (c / sub).mkdir(parents=True)
    for name in STAGE_MODULES:
        shutil.copy2(HERE / name, c / "dflash_image" / name)
    for name in ("pylock.toml", "requirements.txt", "uv.lock", "pyproject.toml"):
        if (lock_dir / name).is_file():
            shutil.copy2(lock_dir / name, c / "lock" / name)
    for w in wheels:
        shutil.copy2(w, c / "wheelhouse" / w.name)
    shutil.copy2(trainer_wheel, c / "trainer" / trainer_wheel.name)
    shutil.copy2(uv(), c / "bin" / "uv")
    # uv records each wheel file's mtime (dist-info/uv_cache.json, listed in RECORD): fix them all.
    for dirpath, _dirs, files in os.walk(ctx):
        for f in files:
            os.utime(os.path.join(dirpath, f), (sde, sde))


def stream_build(client, ctx: Path, tag: str, buildargs: dict, labels: dict, nocache: bool) -> str:
    """Run the build, printing its log as it comes; returns the image id."""
    image_id = None
    last = []
    for chunk in client.api.build(path=str(ctx), tag=tag, buildargs=buildargs, labels=labels, nocache=nocache,
                                  rm=True, forcerm=True, network_mode="none", decode=True, pull=False):
        if "stream" in chunk:
            sys.stdout.write(chunk["stream"])
            sys.stdout.flush()
            last = (last + chunk["stream"].splitlines())[-20:]
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
        if "error" in chunk:
            raise BuildError(f"image build failed: {chunk['error'].strip()}\n  last lines:\n    "
                             + "\n    ".join(last) + "\n  the build has no network: every wheel must be in the "
                             "wheelhouse (`make wheelhouse`) and match the lock")
    if image_id is None:
        image_id = client.images.get(tag).id
    return image_id


def build(lock_dir: Path, wheelhouse_dir: Path, trainer_wheel: Path, out: Path, rootfs_tar: Path | None = None,
          tag: str | None = None, nocache: bool = False, zstd_level: int = 10, docker_url: str | None = None,
          cfg: dict | None = None) -> dict:
    cfg = cfg or rootfs.load_config()
    sde = rootfs.source_date_epoch(cfg)
    lock_sha = lock_digest(lock_dir)
    wheels = _checked_inputs(lock_dir, wheelhouse_dir, trainer_wheel, cfg)
    torch = next((p.version for p in pylock.load(lock_dir / "pylock.toml") if p.name == "torch"), None)
    trainer_version = trainer_wheel.name.split("-")[1]
    client = docker_client(docker_url)
    base_tag = _base_image(client, rootfs_tar or rootfs.build(out, cfg))
    tag = tag or f"dflash-trainenv:{trainer_version}-{lock_sha[:12]}"
    labels = {
        "org.opencontainers.image.title": "dflash-trainenv",
        "org.opencontainers.image.version": f"{trainer_version}-{lock_sha[:12]}",
        "io.dflash.lock.sha256": lock_sha,
        "io.dflash.torch": torch or "none",
        "io.dflash.trainer.sha256": sha256_of(trainer_wheel),
        "io.dflash.base": base_tag,
    }
    with tempfile.TemporaryDirectory(prefix="dflash-image-") as tmp:
        ctx = Path(tmp) / "ctx"
        ctx.mkdir()
        make_context(ctx, lock_dir, wheels, trainer_wheel, sde)
        image_id = stream_build(client, ctx, tag, {"BASE": base_tag, "SOURCE_DATE_EPOCH": str(sde)}, labels, nocache)
        root = _container_rootfs(client, tag, Path(tmp) / "rootfs")
        manifest_sha = sha256_of(manifest.path_for(root / "opt/venv"))
        name = template.template_name(cfg["release"], trainer_version, lock_sha)
        tpl = out / name
        tpl_sha, plain_sha = template.pack(root, tpl, sde, zstd_level)
    oci_path = out / name.replace(".tar.zst", ".oci.tar")
    manifest_digest = _write_oci(tpl, plain_sha, oci_path, tag, labels, sde)
    result = {"image": tag, "image_id": image_id, "template": str(tpl), "template_sha256": tpl_sha,
              "venv_manifest_sha256": manifest_sha,
              "oci_archive": str(oci_path), "oci_manifest": manifest_digest, "labels": labels}
    (out / name.replace(".tar.zst", ".json")).write_text(json.dumps(result, indent=2) + "\n")
    print(f"image: {tag}\ntemplate: {tpl}\n  sha256 {tpl_sha}\noci archive: {oci_path}", flush=True)
    return result


def _checked_inputs(lock_dir: Path, wheelhouse_dir: Path, trainer_wheel: Path, cfg: dict) -> list[Path]:
    """The wheels the image needs, each checked against its sha256, and the trainer wheel, checked before any
    build work; raises BuildError naming what is missing and the command that makes it."""
    pylock_path = lock_dir / "pylock.toml"
    requires = rebuild.python_refused(lock_dir, wheelhouse_dir, cfg["python"])
    if requires:
        raise BuildError(f"{pylock_path} needs Python {requires}, but the image's Debian base has Python {cfg['python']} "
                         "(image/rootfs.toml): lock for the base's Python (image/env/pyproject.toml) or change the base")
    wheels = []
    for _pkg, w in wheelhouse.plan(pylock_path, cfg["python"], glibc=tuple(int(x) for x in cfg["glibc"].split("."))):
        path = wheelhouse_dir / w.filename
        if not path.is_file() or sha256_of(path) != w.sha256:
            raise BuildError(f"{path} is missing or does not match the lock: run `make wheelhouse`")
        wheels.append(path)
    if not trainer_wheel.is_file():
        raise BuildError(f"no trainer wheel at {trainer_wheel}: run `make trainer-wheel`")
    return wheels


def _base_image(client, base_tar: Path) -> str:
    """The Debian base as a docker image, imported once per tarball content; returns its tag."""
    from docker.errors import ImageNotFound

    base_tag = f"dflash-base:{sha256_of(base_tar)[:12]}"
    try:
        client.images.get(base_tag)
    except ImageNotFound:
        print(f"image: importing {base_tar} as {base_tag}", flush=True)
        client.api.import_image_from_file(str(base_tar), repository=base_tag.split(":")[0], tag=base_tag.split(":")[1])
    return base_tag


def _container_rootfs(client, tag: str, root: Path) -> Path:
    """A container of the built image, exported into `root`, scrubbed of Docker's traces and checked as a
    Proxmox template."""
    container = client.containers.create(tag)
    try:
        template.unpack_export(container.export(chunk_size=1 << 21), root)
    finally:
        container.remove(force=True)
    template.scrub(root)
    template.check(root)
    return root


def _write_oci(tpl: Path, plain_sha: str, oci_path: Path, tag: str, labels: dict, sde: int) -> str:
    """The template's layer wrapped as an OCI archive, dated at the snapshot; returns the manifest digest."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(sde))
    env = ["VIRTUAL_ENV=/opt/venv", "PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    return oci.write(tpl, plain_sha, oci_path, tag, labels, env, created)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_image.build", description=__doc__.splitlines()[0])
    ap.add_argument("--lock", type=Path, default=HERE / "env")
    ap.add_argument("--wheelhouse", type=Path, default=Path("wheelhouse"))
    ap.add_argument("--trainer-wheel", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("build/image"))
    ap.add_argument("--rootfs", type=Path, default=None, help="a Debian base tarball (default: build it)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--zstd-level", type=int, default=10)
    args = ap.parse_args(argv)
    try:
        build(args.lock, args.wheelhouse, args.trainer_wheel, args.out, args.rootfs, args.tag, args.no_cache,
              args.zstd_level)
    except (ToolError, pylock.LockError, wheelhouse.WheelhouseError) as exc:
        print(f"image: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
