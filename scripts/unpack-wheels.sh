#!/usr/bin/env bash
# `unpack-wheels.sh PINS DEST`: the hash-pinned wheels listed in PINS, downloaded and unpacked
# into DEST once (again only when PINS changes), under a lock (DEST.lock) so that concurrent
# callers wait for one download. Their programs (`*/bin/*`) are made executable: zip keeps no
# modes. Used by cuda-env.sh (the compiler) and cuda-link.sh (the libraries).
set -euo pipefail
pins="$1"
dest="$2"
exec 9>"$dest.lock"
flock 9
if ! cmp -s "$pins" "$dest/pinned.txt"; then
    echo "unpack-wheels: fetching $(basename "$pins")'s wheels into $dest (once)" >&2
    rm -rf "$dest"
    mkdir -p "$dest/wheels"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
        -r "$pins" -d "$dest/wheels"
    for wheel in "$dest"/wheels/*.whl; do
        python3 -m zipfile -e "$wheel" "$dest"
    done
    rm -rf "$dest/wheels"
    find "$dest" -path '*/bin/*' -type f -exec chmod +x {} +
    cp "$pins" "$dest/pinned.txt"
fi
