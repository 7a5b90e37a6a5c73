#!/bin/sh
# The images' non-root user: `ray`, UID and GID 1000, home /home/ray, shell bash, in no other
# group. KubeRay pods run as UID 1000 (runAsNonRoot in infra/terraform).
#
# Ubuntu 24.04 bases (NGC PyTorch 25.x under TensorRT-LLM 1.2, and vLLM's CUDA images) ship a
# user `ubuntu` with UID 1000 already, where a plain `useradd --uid 1000` exits 4. That user
# (and its group) is renamed to ray instead; a base without one gets a new user. Running it
# again changes nothing.
#
#   sh images/ray-user.sh [ROOT]    ROOT: change ROOT/etc instead of /etc (the tests do)
set -eu

root="${1:-/}"
if [ "$root" = / ]; then
    set --
else
    set -- --prefix "$root"
fi

# Who holds UID 1000 and GID 1000 now (read from the files, as --prefix will change them).
user=$(awk -F: '$3 == 1000 { print $1; exit }' "$root/etc/passwd")
group=$(awk -F: '$3 == 1000 { print $1; exit }' "$root/etc/group")

if [ -z "$group" ]; then
    groupadd "$@" --gid 1000 ray
elif [ "$group" != ray ]; then
    groupmod "$@" --new-name ray "$group"
fi

if [ -z "$user" ]; then
    useradd "$@" --create-home --uid 1000 --gid 1000 --shell /bin/bash ray
else
    if [ "$user" != ray ]; then
        usermod "$@" --login ray --home /home/ray --move-home "$user"
    fi
    usermod "$@" --gid 1000 --groups "" --shell /bin/bash ray
    mkdir -p "$root/home/ray"
    chown 1000:1000 "$root/home/ray"
fi
