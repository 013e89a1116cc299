#!/usr/bin/env bash
# Builds the real docker/Dockerfile with buildah (daemonless: --isolation chroot, vfs storage, as
# root) on a Debian base bootstrapped here (debootstrap minbase + python3 + torch's CPU wheel,
# cached under $CACHE keyed by this recipe and the torch version), then runs megalite inside the
# image as its non-root user with a host directory at /workspace. Prints each step's time and
# the image's size. The README's test command runs it after pytest. See docker/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${MEGALITE_IMAGE_TORCH:-2.13.0}
CACHE=${MEGALITE_IMAGE_CACHE:-/var/cache/megalite-image}
RUN_UID=4321  # the "mounting user": owns the host directory, the image is built for it
BUILDAH=(buildah --root "$CACHE/storage" --runroot /run/megalite-image --storage-driver vfs)
IMAGE=localhost/megalite-check:latest
WORK=$(mktemp -d /var/tmp/megalite-image.XXXXXX)
containers=()
cleanup() {
    for c in "${containers[@]}"; do "${BUILDAH[@]}" rm "$c" >/dev/null 2>&1 || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
step() {  # step NAME COMMAND...: run it, print its time
    local start=$SECONDS
    echo "== $1"; shift
    "$@"
    echo "== done in $((SECONDS - start)) s"
}

install_tools() {
    command -v buildah >/dev/null && command -v debootstrap >/dev/null && return
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap
}

# the Debian mirror apt already uses (deb822 `URIs:` or a one-line `deb URL bookworm`)
apt_mirror() {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
        2>/dev/null | awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}
                           /^deb / && $3 == "bookworm" {print $2; exit}'
}

# -v options mounting the host's pip configuration (merged into one file) and the paths it names
pip_mounts() {
    python docker/pip_mounts.py "$WORK/pip.conf" > "$WORK/pip-paths"
    echo "-v $WORK/pip.conf:/etc/pip.conf:ro"
    while read -r path; do echo "-v $path:$path:ro"; done < "$WORK/pip-paths"
}

build_base() {
    "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1 && { echo "cached: $BASE"; return; }
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$WORK/rootfs" "$(apt_mirror)" >/dev/null
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
    local ctr mnt
    ctr=$("${BUILDAH[@]}" from scratch); containers+=("$ctr")
    mnt=$("${BUILDAH[@]}" mount "$ctr")
    cp -a "$WORK/rootfs/." "$mnt/"
    rm -rf "$WORK/rootfs"
    "${BUILDAH[@]}" umount "$ctr" >/dev/null
    "${BUILDAH[@]}" config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$ctr"
    # shellcheck disable=SC2046  # one -v option per line
    "${BUILDAH[@]}" run --isolation chroot $(pip_mounts) "$ctr" -- sh -c \
        "python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir torch==$TORCH_VERSION+cpu \
         || /opt/venv/bin/pip install --no-cache-dir --retries 1 --timeout 20 --index-url https://download.pytorch.org/whl/cpu torch==$TORCH_VERSION+cpu"
    "${BUILDAH[@]}" commit --rm "$ctr" "$BASE" >/dev/null
    containers=()
    # older bases (another recipe or torch) are stale: drop them
    "${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/megalite-base:' \
        | grep -v ":$KEY\$" | xargs -r "${BUILDAH[@]}" rmi >/dev/null || true
}

build_image() {
    # shellcheck disable=SC2046
    "${BUILDAH[@]}" bud --isolation chroot --layers=false $(pip_mounts) \
        --build-arg BASE="$BASE" --build-arg MEGALITE_UID=$RUN_UID \
        -f docker/Dockerfile -t "$IMAGE" . >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; return 1; }
    "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
}

STEP_LIMIT_S=${STEP_LIMIT_S:-300}  # an in-image step that hangs (a rendezvous) fails, never stalls CI

in_image() {  # in_image ARGS...: run in the image as the mounting user, /workspace mounted
    # gloo finds its interface through the hostname, which the image's /etc/hosts lacks
    "${BUILDAH[@]}" run --isolation chroot --user $RUN_UID:$RUN_UID --env GLOO_SOCKET_IFNAME=lo \
        -v "$WORK/workspace:/workspace" "$RUN_CTR" -- timeout -k 10 "$STEP_LIMIT_S" "$@"
}

check_owner() {
    local owner
    owner=$(stat -c %u "$WORK/workspace/$1")
    [[ "$owner" == "$RUN_UID" ]] || { echo "$1 is owned by uid $owner, not $RUN_UID"; return 1; }
}

check_layers() {  # no secret-looking file and no .git in any layer of the image
    "${BUILDAH[@]}" push "$IMAGE" "oci-archive:$WORK/image.tar" >/dev/null
    mkdir "$WORK/oci" && tar -C "$WORK/oci" -xf "$WORK/image.tar"
    local layer found=0
    for layer in "$WORK"/oci/blobs/sha256/*; do
        tar -tzf "$layer" >"$WORK/files" 2>/dev/null || tar -tf "$layer" >"$WORK/files" 2>/dev/null || continue
        if grep -E '(^|/)(\.git|\.env(\..*)?|\.netrc|id_rsa[^/]*|[^/]*\.pem|[^/]*\.key)/?$' "$WORK/files" \
                | grep -v '^\(\./\)\?\(usr\|etc\|opt/venv\)/'; then found=1; fi
    done
    rm -rf "$WORK/oci" "$WORK/image.tar"
    [[ $found == 0 ]] || { echo "secret-looking files or .git in the image's layers (above)"; return 1; }
}

# 2 local ranks, the store on 127.0.0.1: --standalone names the container's hostname, unresolved
LOCAL_RANKS=(--nnodes=1 --nproc_per_node=2 --master-addr=127.0.0.1 --master-port=29517)

main() {
    # the base's cache key: its recipe (the functions below) and the torch version
    KEY=$( (declare -f build_base apt_mirror pip_mounts; echo "$TORCH_VERSION") | sha256sum | cut -c1-16)
    BASE=localhost/megalite-base:$KEY
    step "buildah and debootstrap" install_tools
    step "base image $BASE (debootstrap bookworm minbase, python3, torch $TORCH_VERSION CPU)" build_base
    step "docker/Dockerfile built on it" build_image
    echo "image size: $("${BUILDAH[@]}" images --format '{{.Size}}' "$IMAGE")"
    step "no secret or .git in the image's layers" check_layers
    mkdir "$WORK/workspace" && chown $RUN_UID:$RUN_UID "$WORK/workspace"
    RUN_CTR=$("${BUILDAH[@]}" from --pull-never "$IMAGE"); containers+=("$RUN_CTR")
    step "megalite-prepare of the stdlib corpus" in_image megalite-prepare data=stdlib \
        data.max_documents=300
    step "quickstart: torchrun, 2 ranks, 4 steps, a checkpoint" in_image torchrun "${LOCAL_RANKS[@]}" \
        /opt/megalite/scripts/pretrain.py model=tiny data=stdlib \
        train.max_steps=4 train.eval_every=100 checkpoint.every=2 hydra.run.dir=outputs/quick
    check_owner outputs/quick/metrics.jsonl
    step "the checkpoint resumed to step 6" in_image torchrun "${LOCAL_RANKS[@]}" \
        /opt/megalite/scripts/pretrain.py model=tiny data=stdlib train.max_steps=6 \
        train.eval_every=100 checkpoint.every=2 checkpoint.resume=auto hydra.run.dir=outputs/quick
    step "megalite-selftest under 2 ranks" in_image torchrun "${LOCAL_RANKS[@]}" \
        --no-python megalite-selftest model=tiny data=stdlib --report-dir selftest
    step "megalite-export, loaded by transformers" in_image sh -c \
        'megalite-export outputs/quick/checkpoints exported && python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained(\"exported\"); print(\"transformers loads exported/\")"'
    echo "image check passed"
}
main
