#!/usr/bin/env bash
# Builds a qtx container image on this machine with no registry and no Docker
# engine, then runs it and checks it from the host:
#   1. base: a minimal Debian 12 made with debootstrap (--variant=minbase),
#      imported into buildah as localhost/qtx-base:bookworm (made once, kept);
#   2. image: the relocatable bundle of BUNDLE_DIR (deploy/bundle/make_bundle.sh:
#      qtxd, qtx and the shared libraries they need) in /opt/qtx on that base,
#      user qtx (10001), entrypoint `/opt/qtx/run qtxd --health_port=8081`;
#      committed as localhost/qtx:KIND;
#   3. check: starts qtxd in the image (buildah run, chroot isolation: the
#      host's network, a host folder mounted at /run/qtx) and from the host
#      asks for health through the mounted socket and through --health_port,
#      and runs a Quantize through the socket.
#
#   docker/build_image.sh cpu|cuda BUNDLE_DIR
#
# KIND cpu: the bundle of a build without CUDA; cuda: the bundle of a CUDA
# build (CUDA runtime linked statically; the driver, libcuda, comes from the
# host through the NVIDIA container runtime's usual variables,
# NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES=compute,utility, which the
# image sets; NCCL from the host: mount it and set QTX_NCCL_LIB). Both images
# are checked with --device=cpu here (no GPU container host).
# Needs root, debootstrap and buildah (QTX_DEPS=images scripts/install_deps.sh).
# Storage: vfs, isolation: chroot (work inside an unprivileged container too).
# QTX_IMAGE_WORK (default /var/tmp/qtx-images) keeps the debootstrap tree.
set -euo pipefail
if [ $# -ne 2 ] || [[ "$1" != cpu && "$1" != cuda ]]; then
  echo "usage: $0 cpu|cuda BUNDLE_DIR" >&2
  exit 2
fi
kind="$1"
bundle="$(cd "$2" && pwd)"
[ -x "$bundle/run" ] && [ -x "$bundle/bin/qtxd" ] && [ -x "$bundle/bin/qtx" ] \
  || { echo "build_image: $bundle is not a qtx bundle (make_bundle.sh)" >&2; exit 1; }
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot BUILDAH_FORMAT=docker  # docker: keeps HEALTHCHECK
B=(buildah --storage-driver vfs)
work="${QTX_IMAGE_WORK:-/var/tmp/qtx-images}"
base=localhost/qtx-base:bookworm
image="localhost/qtx:$kind"
t0=$SECONDS
say() { echo "build_image: [$((SECONDS - t0)) s] $*"; }

# 1. The base image.
if ! "${B[@]}" inspect --type image "$base" >/dev/null 2>&1; then
  mkdir -p "$work"
  if [ ! -x "$work/rootfs/bin/sh" ]; then
    say "debootstrap --variant=minbase bookworm"
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian \
      >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log"; exit 1; }
  fi
  # What a runtime image does not need: package caches and lists, docs.
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"* \
    "$work/rootfs/usr/share/doc/"* "$work/rootfs/usr/share/man/"*
  tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
  c="$("${B[@]}" from scratch)"
  "${B[@]}" add "$c" "$work/rootfs.tar" / >/dev/null
  "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/sh --label org.opencontainers.image.description="Debian 12 minbase (debootstrap)" "$c"
  "${B[@]}" commit -q "$c" "$base" >/dev/null
  "${B[@]}" rm "$c" >/dev/null
  rm -f "$work/rootfs.tar"
  say "base image $base made"
else
  say "base image $base present"
fi

# 2. The qtx image.
c="$("${B[@]}" from "$base")"
trap '"${B[@]}" rm "$c" >/dev/null 2>&1 || true' EXIT
"${B[@]}" run --isolation=chroot "$c" -- sh -c \
  'groupadd --gid 10001 qtx &&
   useradd --no-log-init --uid 10001 --gid qtx --home-dir /var/lib/qtx --create-home qtx &&
   mkdir -p /run/qtx /var/lib/qtx/checkpoints && chown qtx:qtx /run/qtx /var/lib/qtx/checkpoints'
"${B[@]}" copy --chown 0:0 "$c" "$bundle" /opt/qtx >/dev/null
entry='["/opt/qtx/run", "qtxd", "--health_port=8081"]'
cmd='["--socket=/run/qtx/qtxd.sock"]'
env=()
if [ "$kind" = cpu ]; then
  entry='["/opt/qtx/run", "qtxd", "--device=cpu", "--health_port=8081"]'
else
  cmd='["--socket=/run/qtx/qtxd.sock", "--device=cuda:0"]'
  env=(--env NVIDIA_VISIBLE_DEVICES=all --env NVIDIA_DRIVER_CAPABILITIES=compute,utility
       --env NCCL_NVLS_ENABLE=0)
fi
"${B[@]}" config --cmd "$cmd" "$c"
"${B[@]}" config --user 10001:10001 --workingdir /var/lib/qtx \
  --port 8081 --port 9090 --port 50051 "${env[@]}" \
  --healthcheck 'CMD /opt/qtx/run qtx --target=127.0.0.1:8081 --timeout=2s health' \
  --healthcheck-interval 10s --healthcheck-timeout 3s --healthcheck-start-period 10s \
  --healthcheck-retries 3 \
  --entrypoint "$entry" \
  --label org.opencontainers.image.title="qtx ($kind)" "$c"
"${B[@]}" commit -q --format docker "$c" "$image" >/dev/null
"${B[@]}" rm "$c" >/dev/null
trap - EXIT
say "image $image committed ($("${B[@]}" images --format '{{.Size}}' "$image" 2>/dev/null || echo '?'))"

# 3. Run it and check it from the host.
tmp="$(mktemp -d /tmp/qtx-image-check-XXXXXX)"
chmod 0777 "$tmp"  # qtxd runs as uid 10001 in the image and creates its socket here
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
c="$("${B[@]}" from "$image")"
# The CUDA build links NCCL dynamically and the image does not carry it: as
# on a GPU host, the host's NCCL is mounted and named by QTX_NCCL_LIB.
nccl=()
if [ "$kind" = cuda ]; then
  nccl_dir="${QTX_NCCL_HOST_DIR:-$(dirname "$(ldconfig -p | awk '/libnccl.so.2 / {print $NF; exit}')")}"
  [ -e "$nccl_dir/libnccl.so.2" ] || { echo "build_image: no libnccl.so.2 on this host (QTX_NCCL_HOST_DIR)" >&2; exit 1; }
  nccl=(--volume "$nccl_dir:/opt/nccl:ro" --env QTX_NCCL_LIB=/opt/nccl)
fi
# buildah run does not use the entrypoint: the same command, spelled out;
# the pid is written first so the check can stop exactly this qtxd.
"${B[@]}" run --isolation=chroot --user 10001:10001 --volume "$tmp:/run/qtx" "${nccl[@]}" "$c" -- \
  sh -c "echo \$\$ > /run/qtx/qtxd.pid; exec /opt/qtx/run qtxd --device=cpu \
         --socket=/run/qtx/qtxd.sock --health_port=$port --log_level=warn" \
  >"$tmp/qtxd.log" 2>&1 &
runner=$!
cleanup() {
  if [ -s "$tmp/qtxd.pid" ]; then kill -TERM "$(cat "$tmp/qtxd.pid")" 2>/dev/null || true; fi
  wait "$runner" 2>/dev/null || true
  "${B[@]}" rm "$c" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
qtx=("$bundle/run" qtx)
ok=""
for _ in $(seq 1 150); do
  if "${qtx[@]}" --target="unix://$tmp/qtxd.sock" --timeout=2s health >/dev/null 2>&1; then ok=1; break; fi
  kill -0 "$runner" 2>/dev/null || break
  sleep 0.2
done
[ -n "$ok" ] || { cat "$tmp/qtxd.log"; echo "build_image: qtxd in $image never served" >&2; exit 1; }
say "qtxd in $image: socket $("${qtx[@]}" --target="unix://$tmp/qtxd.sock" health)"
say "qtxd in $image: health port $("${qtx[@]}" --target="127.0.0.1:$port" --timeout=2s health)"
out="$("${qtx[@]}" --target="unix://$tmp/qtxd.sock" quantize --shape=256x512 \
        --usages=rowwise,columnwise)"
echo "$out"
grep -q "dequant err" <<<"$out" || { echo "build_image: Quantize through the socket failed" >&2; exit 1; }
kill -TERM "$(cat "$tmp/qtxd.pid")"
if ! wait "$runner"; then
  cat "$tmp/qtxd.log"; echo "build_image: qtxd in $image did not exit cleanly on SIGTERM" >&2; exit 1
fi
[ ! -e "$tmp/qtxd.sock" ] || { echo "build_image: the socket was left behind" >&2; exit 1; }
say "image $image built, served health + Quantize through the mounted socket, stopped cleanly"
