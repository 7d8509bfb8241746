#!/usr/bin/env bash
# Pin a Dockerfile's base images by digest: each `ARG <NAME>_IMAGE=<image>:<tag>[@sha256:...]`
# line gets the digest the tag points to now, as `<image>:<tag>@sha256:<digest>` (the tag stays
# for the reader; Docker pulls by the digest). Run it when you move to a new tag, or to take a
# rebuilt tag's security fixes; then rebuild, test, and commit the Dockerfile (docs/gpu.md).
#
#   scripts/pin-base-images.sh [--check] [DOCKERFILE...]     (default: Dockerfile.gpu)
#
# --check changes nothing: it prints each image as pinned, unpinned or moved (the tag now points
# elsewhere) and exits 1 if any is not pinned to the tag's current digest.
#
# The digest is the registry's, for the tag's manifest list (all platforms), from the first of:
# $DIGEST_RESOLVER (a command given the reference that prints its digest), `crane digest`, or
# `docker buildx imagetools inspect`. All of them need the network and the registry's consent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

check=0
files=()
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    -h | --help)
      sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "pin-base-images: unknown option $arg (see --help)" >&2
      exit 2
      ;;
    *) files+=("$arg") ;;
  esac
done
[ ${#files[@]} -gt 0 ] || files=("$root/Dockerfile.gpu")

resolve() { # REFERENCE -> prints sha256:<64 hex>
  local ref=$1 out
  if [ -n "${DIGEST_RESOLVER:-}" ]; then
    out=$($DIGEST_RESOLVER "$ref")
  elif command -v crane >/dev/null 2>&1; then
    out=$(crane digest "$ref")
  elif command -v docker >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1; then
    out=$(docker buildx imagetools inspect "$ref" | awk '$1 == "Digest:" {print $2; exit}')
  else
    echo "pin-base-images: no way to ask the registry: install crane or docker buildx, or set DIGEST_RESOLVER" >&2
    return 2
  fi
  out=$(printf '%s' "$out" | tr -d '[:space:]')
  if [[ ! "$out" =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "pin-base-images: $ref: the registry gave no digest (got '$out')" >&2
    return 3
  fi
  printf '%s\n' "$out"
}

status=0
for file in "${files[@]}"; do
  [ -f "$file" ] || {
    echo "pin-base-images: no such file: $file" >&2
    exit 2
  }
  found=0
  while IFS= read -r line; do
    name=${line#ARG }
    name=${name%%=*}
    value=${line#*=}
    tag=${value%%@*}
    pinned=""
    [ "$tag" = "$value" ] || pinned=${value#*@}
    found=1
    digest=$(resolve "$tag")
    if [ "$check" = 1 ]; then
      if [ -z "$pinned" ]; then
        echo "$file: $name=$tag is not pinned (now $digest)"
        status=1
      elif [ "$pinned" != "$digest" ]; then
        echo "$file: $name=$tag is pinned to $pinned but the tag has moved to $digest"
        status=1
      else
        echo "$file: $name=$tag is pinned to its current digest"
      fi
    elif [ "$pinned" != "$digest" ]; then
      # Replace the whole line; '|' cannot occur in an image reference.
      sed -i "s|^ARG $name=.*\$|ARG $name=$tag@$digest|" "$file"
      echo "$file: $name=$tag@$digest"
    else
      echo "$file: $name=$tag already pinned to $digest"
    fi
  done < <(grep -E '^ARG [A-Z0-9_]+_IMAGE=' "$file")
  if [ "$found" = 0 ]; then
    echo "pin-base-images: $file has no 'ARG <NAME>_IMAGE=...' line to pin" >&2
    status=2
  fi
done
exit $status
