#!/usr/bin/env bash
# Builds the Docker images and runs them: what tests/tests/images.rs checks without a Docker
# daemon (build context, command lines), done for real.
#
#   scripts/check-images.sh                 # CPU images: build, then serve and train
#   scripts/check-images.sh --cuda          # also build the CUDA images (no GPU needed to build;
#                                           # they are not started)
#   scripts/check-images.sh --if-available  # no usable Docker: say so and exit 0 (else exit 1)
#   scripts/check-images.sh --no-compose    # skip the compose step (below)
#
# Steps: build docker/Dockerfile's `trainer` and `teacher` targets; make a tiny random teacher
# and student with the trainer image (`trainer init-model`, the llama2 tokenizer from
# scripts/get-tokenizers.sh); start the teacher image (its own ENTRYPOINT + CMD) on that model;
# wait until Docker's HEALTHCHECK reports it healthy; score one request with curl; run the
# trainer image for two off-policy steps against it, as compose's `trainer` service does
# (configs/ read-only, a runs/ folder holding the student, `--resume`); stop everything. Then
# docker/compose.yaml as its header tells users to run it (`docker compose`, or Docker Compose
# v1's `docker-compose`, in a project of its own; `--build` rebuilds the `:latest` images from
# this tree, from BuildKit's cache): `up teacher` until healthy and scoring, the `train`
# profile's trainer against it (its own command line, which resumes), and the `scale` profile:
# three replicas behind the balancer, each client's affinity header answered through it.
# Needs: docker (a reachable daemon that can pull rust:1-slim-bookworm and
# debian:bookworm-slim, haproxy:2.6 for the compose step, plus the nvidia/cuda images with
# --cuda; where Docker Hub is out of reach, scripts/docker-local-bases.sh makes local
# stand-ins), curl, and the tokenizers.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if_available=0 cuda=0 compose=1
for a in "$@"; do
  case "$a" in
    --if-available) if_available=1 ;;
    --cuda) cuda=1 ;;
    --no-compose) compose=0 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "check-images: unknown argument $a" >&2; exit 2 ;;
  esac
done

# No Docker (no client, no daemon, or base images that cannot be pulled): one line, then exit.
unavailable() {
  if [ "$if_available" = 1 ]; then
    echo "check-images: skipped: $1"
    exit 0
  fi
  echo "check-images: $1" >&2
  exit 1
}
command -v docker >/dev/null || unavailable "no docker client on PATH"
docker info >/dev/null 2>&1 || unavailable "no Docker daemon reachable (docker info failed)"
bases=(rust:1-slim-bookworm debian:bookworm-slim)
[ "$compose" = 1 ] && bases+=(haproxy:2.6)
for base in "${bases[@]}"; do
  docker image inspect "$base" >/dev/null 2>&1 || docker pull -q "$base" >/dev/null 2>&1 \
    || unavailable "cannot pull the base image $base"
done
command -v curl >/dev/null || { echo "check-images: curl is needed" >&2; exit 1; }
if [ "$compose" = 1 ]; then
  if docker compose version >/dev/null 2>&1; then compose_cmd=(docker compose)
  elif command -v docker-compose >/dev/null; then compose_cmd=(docker-compose)
  else unavailable "no docker compose (or docker-compose) for the compose step (--no-compose skips it)"
  fi
fi

tag=check-$$
teacher_image=xdistill-teacher:$tag trainer_image=xdistill-trainer:$tag
work=$(mktemp -d)
net=xdistill-check-$$ teacher=xdistill-check-teacher-$$
project=xdistill-check-$$ free_port=8000
dc() {
  TEACHER_MODEL_DIR="$work/models/teacher" TRAINER_RUNS_DIR="$work/runs" TEACHER_PORT="$free_port" \
    BALANCER_PORT="$free_port" COMPOSE_DOCKER_CLI_BUILD=1 \
    "${compose_cmd[@]}" -p "$project" -f "$root/docker/compose.yaml" "$@"
}
cleanup() {
  [ "$compose" = 1 ] && dc --profile scale --profile train down -t 5 >/dev/null 2>&1 || true
  docker rm -f "$teacher" >/dev/null 2>&1 || true
  docker network rm "$net" >/dev/null 2>&1 || true
  docker image rm "$teacher_image" "$trainer_image" >/dev/null 2>&1 || true
  # Files the containers wrote as uid 10001: removed from a container as that user.
  docker run --rm -v "$work:/w" --entrypoint /bin/sh debian:bookworm-slim -c 'rm -rf /w/*' \
    >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
step() { echo "== $*" >&2; }

step "building $trainer_image and $teacher_image (docker/Dockerfile)"
export DOCKER_BUILDKIT=1
docker build -f "$root/docker/Dockerfile" --target trainer -t "$trainer_image" "$root"
docker build -f "$root/docker/Dockerfile" --target teacher -t "$teacher_image" "$root"
if [ "$cuda" = 1 ]; then
  step "building the CUDA images (docker/Dockerfile.cuda)"
  docker build -f "$root/docker/Dockerfile.cuda" --target trainer -t "xdistill-trainer:cuda-$tag" "$root"
  docker build -f "$root/docker/Dockerfile.cuda" --target teacher -t "xdistill-teacher:cuda-$tag" "$root"
  docker image rm "xdistill-trainer:cuda-$tag" "xdistill-teacher:cuda-$tag" >/dev/null
fi

step "making a tiny teacher and student with the trainer image"
tok=$("$root/scripts/get-tokenizers.sh")/llama2
mkdir -p "$work/models" "$work/runs"
chmod 0777 "$work/models" "$work/runs" # written by the images' uid 10001
for m in teacher:1 student:2; do
  docker run --rm -v "$tok:/tok:ro" -v "$work/models:/out" "$trainer_image" init-model \
    --arch llama --tokenizer /tok/tokenizer.json --hidden-size 64 --layers 2 --heads 4 \
    --kv-heads 2 --intermediate-size 128 --max-position-embeddings 1024 \
    --seed "${m#*:}" --out "/out/${m%%:*}"
done
docker run --rm -v "$work:/w" --entrypoint /bin/sh debian:bookworm-slim \
  -c 'cp -r /w/models/student /w/runs/student && chmod -R a+rwX /w/runs'

step "starting $teacher_image (its own command line) and waiting for its HEALTHCHECK"
docker network create "$net" >/dev/null
docker run -d --name "$teacher" --network "$net" --network-alias teacher \
  -p 127.0.0.1::8000 -v "$work/models/teacher:/models/teacher:ro" "$teacher_image" >/dev/null
status=starting
for _ in $(seq 1 120); do
  status=$(docker inspect --format '{{.State.Health.Status}}' "$teacher")
  [ "$status" = healthy ] && break
  if [ "$status" = unhealthy ] || [ "$(docker inspect --format '{{.State.Running}}' "$teacher")" != true ]; then
    break
  fi
  sleep 2
done
if [ "$status" != healthy ]; then
  docker logs "$teacher" >&2 || true
  echo "check-images: the teacher is $status, not healthy" >&2
  exit 1
fi
port=$(docker port "$teacher" 8000/tcp | head -n 1 | sed 's/.*://')
echo "healthy on 127.0.0.1:$port" >&2

step "scoring one request"
answer=$(curl -fsS "http://127.0.0.1:$port/topk_logits" -H 'content-type: application/json' \
  -d '{"sequences": [[1, 450, 4996, 17354, 1701]], "k": 5}')
case "$answer" in
  *'"results"'*) echo "${answer:0:200}…" >&2 ;;
  *) echo "check-images: unexpected answer: $answer" >&2; exit 1 ;;
esac

step "training the student for two steps with $trainer_image (compose's trainer service layout)"
run_trainer() {
  docker run --rm --network "$net" -v "$root/configs:/work/configs:ro" -v "$work/runs:/work/runs" \
    "$trainer_image" off-policy --config /work/configs/off_policy.toml \
    --teacher-url http://teacher:8000 --resume --max-steps 2 \
    --set checkpointing.save_period=1
}
run_trainer
# The same command again resumes from the checkpoint the first run left.
run_trainer 2>&1 | tee "$work/second.log" >&2
grep -q "resumed from" "$work/second.log" || { echo "check-images: the restart did not resume" >&2; exit 1; }

step "stopping the teacher (SIGTERM, graceful)"
docker stop -t 60 "$teacher" >/dev/null
if [ "$compose" = 0 ]; then
  echo "check-images: ok (images built, teacher healthy and scoring, trainer trained and resumed)"
  exit 0
fi

# Waits until every running container of compose service $1 (this project's) reports healthy
# (at most 4 minutes); prints their names.
wait_healthy() {
  local names status
  for _ in $(seq 1 120); do
    names=$(docker ps --filter "label=com.docker.compose.project=$project" \
      --filter "label=com.docker.compose.service=$1" --format '{{.Names}}')
    status=$(for n in $names; do docker inspect --format '{{.State.Health.Status}}' "$n"; done | sort -u)
    [ -n "$names" ] && [ "$status" = healthy ] && { echo "$names"; return 0; }
    sleep 2
  done
  for n in $names; do docker logs "$n" >&2 || true; done
  echo "check-images: compose's $1 is not healthy ($status)" >&2
  return 1
}
score() { # score PORT AFFINITY: one request, its answer's model field checked
  local answer
  answer=$(curl -fsS "http://127.0.0.1:$1/topk_logits" -H 'content-type: application/json' \
    -H "X-Xdistill-Affinity: $2" -d '{"sequences": [[1, 450, 4996, 17354, 1701]], "k": 5}')
  case "$answer" in
    *'"results"'*) ;;
    *) echo "check-images: unexpected answer through compose: $answer" >&2; return 1 ;;
  esac
}
free_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

step "compose: up teacher (docker/compose.yaml, project $project, port $free_port)"
dc up -d --build teacher >&2
wait_healthy teacher >/dev/null
score "$free_port" compose
echo "healthy and scoring on 127.0.0.1:$free_port" >&2

step "compose: the train profile's trainer against the teacher service (resumes the run above)"
dc --profile train up --build --exit-code-from trainer trainer > "$work/compose-train.log" 2>&1 \
  || { cat "$work/compose-train.log" >&2; echo "check-images: compose's trainer failed" >&2; exit 1; }
grep -q "resumed from" "$work/compose-train.log" \
  || { cat "$work/compose-train.log" >&2; echo "check-images: compose's trainer did not resume" >&2; exit 1; }
grep -o '"steps":[0-9]*' "$work/compose-train.log" | tail -n 1 >&2

step "compose: the scale profile (three replicas behind the balancer)"
dc stop teacher >&2
dc --profile scale up -d --build --scale teacher-replica=3 balancer >&2
replicas=$(wait_healthy teacher-replica)
[ "$(echo "$replicas" | wc -l)" = 3 ] || { echo "check-images: not three replicas: $replicas" >&2; exit 1; }
for i in $(seq 1 12); do
  ok=0
  for _ in $(seq 1 30); do score "$free_port" "client-$i" 2>/dev/null && { ok=1; break; }; sleep 1; done
  [ "$ok" = 1 ] || { dc --profile scale logs balancer >&2 || true; score "$free_port" "client-$i"; exit 1; }
done
dc --profile scale --profile train down -t 30 >&2
echo "check-images: ok (images built, teacher healthy and scoring, trainer trained and resumed; compose: teacher, trainer, three replicas behind HAProxy)"
