"""The in-tree PEP 517 backend of the ``oxrl`` Python package: it needs nothing but the standard
library, so ``pip install ./python`` works offline and without setuptools.

``OXRL_WHEEL_BINARY=/path/to/oxrl pip wheel ./python`` builds a wheel that carries the binary as
``oxrl/bin/oxrl`` (tagged for this platform); without it the wheel is pure Python and finds the
binary on ``PATH`` or through ``OXRL_BINARY``.
"""

import base64
import hashlib
import os
import re
import sysconfig
import zipfile

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project():
    text = open(os.path.join(_HERE, "pyproject.toml"), encoding="utf-8").read()

    def field(name):
        found = re.search(rf'^{name}\s*=\s*"([^"]*)"', text, re.M)
        if not found:
            raise RuntimeError(f"pyproject.toml has no [project] {name}")
        return found.group(1)

    return field("name"), field("version"), field("description"), field("requires-python")


def _metadata():
    name, version, description, requires_python = _project()
    readme = open(os.path.join(_HERE, "README.md"), encoding="utf-8").read()
    return (
        "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\nSummary: {description}\n"
        f"Requires-Python: {requires_python}\nLicense: Apache-2.0\n"
        "Provides-Extra: ray\nRequires-Dist: ray>=2.9; extra == \"ray\"\n"
        "Description-Content-Type: text/markdown\n\n" + readme
    )


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    name, version, _, _ = _project()
    dist_info = f"{name}-{version}.dist-info"
    os.makedirs(os.path.join(metadata_directory, dist_info), exist_ok=True)
    with open(os.path.join(metadata_directory, dist_info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    return dist_info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name, version, _, _ = _project()
    binary = os.environ.get("OXRL_WHEEL_BINARY")
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    tag = f"py3-none-{platform}" if binary else "py3-none-any"
    dist_info = f"{name}-{version}.dist-info"
    wheel_name = f"{name}-{version}-{tag}.whl"
    files = []
    package = os.path.join(_HERE, "oxrl")
    for file in sorted(os.listdir(package)):
        if file.endswith(".py"):
            with open(os.path.join(package, file), "rb") as f:
                files.append((f"oxrl/{file}", f.read(), 0o644))
    if binary:
        with open(binary, "rb") as f:
            files.append(("oxrl/bin/oxrl", f.read(), 0o755))
    files.append((f"{dist_info}/METADATA", _metadata().encode(), 0o644))
    wheel = (
        f"Wheel-Version: 1.0\nGenerator: oxrl_build\nRoot-Is-Purelib: {'false' if binary else 'true'}\n"
        f"Tag: {tag}\n"
    )
    files.append((f"{dist_info}/WHEEL", wheel.encode(), 0o644))
    record = [_record_line(path, data) for path, data, _ in files]
    record.append(f"{dist_info}/RECORD,,")
    files.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode(), 0o644))
    os.makedirs(wheel_directory, exist_ok=True)
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel_name), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data, mode in files:
            info = zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return wheel_name
