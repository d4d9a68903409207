"""The sandbox image: Debian's python3 with numpy, sympy and scipy, and a non-root user.

Two ways to the same content:
  * `sandbox/Dockerfile`, for machines that can pull a base image;
  * `build_image()` (`rstar sandbox build-image`), offline: a debootstrap root file
    system from Debian's package mirror, imported with `docker import`.
The server itself is mounted into each container at run time, so the image only
changes when its package list does; the tag is derived from that list.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

REPOSITORY = "rstar-sandbox"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-numpy", "python3-sympy", "python3-scipy")
SANDBOX_USER = "sandbox:x:10001:10001:rstar sandbox:/tmp:/usr/sbin/nologin\n"
SANDBOX_GROUP = "sandbox:x:10001:\n"
log = logging.getLogger("rstar_sandbox")


def image_version() -> str:
    recipe = f"{SUITE}|{','.join(PACKAGES)}|{SANDBOX_USER}"
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def default_image() -> str:
    return f"{REPOSITORY}:{image_version()}"


class ImageMissing(RuntimeError):
    pass


def require_image(client, image: str) -> None:
    import docker

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ImageMissing(
            f"sandbox image {image} is not built: run `rstar sandbox build-image` "
            "(offline, about 3 minutes) or build sandbox/Dockerfile with that tag"
        ) from None


def build_image(client=None, image: str | None = None) -> tuple[str, bool]:
    """Build the image offline unless the tag exists. Returns (tag, built)."""
    import docker

    client = client or docker.from_env()
    image = image or default_image()
    try:
        client.images.get(image)
        return image, False
    except docker.errors.ImageNotFound:
        pass
    if shutil.which("debootstrap") is None:
        raise RuntimeError(
            "building the sandbox image needs debootstrap (apt-get install debootstrap)"
        )
    with tempfile.TemporaryDirectory(prefix="rstar-sandbox-root-") as tmp:
        root = Path(tmp) / "root"
        log.info("debootstrap %s into %s (a few minutes)", SUITE, root)
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(root),
                MIRROR,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(root / "etc" / "passwd", "a") as fh:
            fh.write(SANDBOX_USER)
        with open(root / "etc" / "group", "a") as fh:
            fh.write(SANDBOX_GROUP)
        shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (root / "opt" / "rstar").mkdir(parents=True, exist_ok=True)
        (root / "run" / "rstar").mkdir(parents=True, exist_ok=True)
        archive = Path(tmp) / "root.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(archive), "."], check=True)
        repository, tag = image.split(":", 1)
        # From a file, not a stream: the SDK's chunked upload is refused by the engine.
        client.api.import_image_from_file(
            str(archive),
            repository=repository,
            tag=tag,
            changes=["USER 10001:10001", "WORKDIR /tmp", 'CMD ["python3"]'],
        )
    client.images.get(image)
    return image, True
