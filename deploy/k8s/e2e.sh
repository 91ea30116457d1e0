#!/usr/bin/env bash
# Real-cluster end-to-end check of the Kubernetes deployment. Runs only when KUBECONFIG is set
# (no cluster is reachable where tierckpt's tests run; there every manifest is validated offline).
#
#   KUBECONFIG=~/.kube/config IMAGE=registry/tierckpt-train:tag deploy/k8s/e2e.sh [jobset|pytorchjob]
#
# Needs: kubectl, the JobSet controller (or the Kubeflow training operator for pytorchjob), an
# image with tierckpt and torch whose /app/train.py prints "Loss:" lines and saves with tierckpt.
# Steps: apply the node agent (deploy/k8s/base), render the example job for 2 nodes, wait for
# training, kill one trainer process (kill -9 inside the pod: tierckpt run restarts it in place),
# check the events show a process restart and the job finishes; then clean up.
set -euo pipefail
if [[ -z "${KUBECONFIG:-}" ]]; then
  echo "e2e.sh: KUBECONFIG is not set; skipping the real-cluster test" >&2
  exit 0
fi
TARGET="${1:-jobset}"
IMAGE="${IMAGE:?set IMAGE to a training image with tierckpt installed}"
NS="${NS:-tierckpt-e2e}"
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="$(mktemp -d)"
trap 'kubectl delete namespace "$NS" --wait=false >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n tierckpt get secret tierckpt-agent >/dev/null 2>&1 || {
  kubectl create namespace tierckpt --dry-run=client -o yaml | kubectl apply -f -
  kubectl -n tierckpt create secret generic tierckpt-agent --from-literal=secret="$(openssl rand -hex 32)"
}
kubectl apply -k "$HERE/base"
kubectl -n tierckpt rollout status daemonset/tierckpt-agent --timeout=300s

python3 - "$HERE/examples/llama3_1_8b-fsdp-hpto.yaml" "$WORK/job.yaml" "$IMAGE" "$NS" <<'PY'
import sys, yaml
src, dst, image, ns = sys.argv[1:]
job = yaml.safe_load(open(src))
job["metadata"].update(name="tierckpt-e2e", namespace=ns)
job["metadata"].pop("labels", None)
job["spec"]["nprocPerNode"] = "1"
rs = job["spec"]["replicaSpecs"][0]
rs["replicas"] = 2
c = rs["template"]["spec"]["containers"][0]
c.update(image=image, resources={}, command=["hyperpodrun", "--nproc_per_node=1", "/app/train.py"])
yaml.safe_dump(job, open(dst, "w"))
PY
tierckpt k8s render "$WORK/job.yaml" --target "$TARGET" --node-agent daemonset -o "$WORK/manifests.yaml"
kubectl apply -f "$WORK/manifests.yaml"

pod=""
for _ in $(seq 120); do
  pod="$(kubectl -n "$NS" get pods -o name | head -n1 || true)"
  [[ -n "$pod" ]] && kubectl -n "$NS" logs "$pod" 2>/dev/null | grep -q "Loss:" && break
  sleep 5
done
[[ -n "$pod" ]] || { echo "e2e.sh: no training pod came up" >&2; exit 1; }
echo "e2e.sh: training runs in $pod; killing one worker"
kubectl -n "$NS" exec "$pod" -- sh -c 'pkill -9 -f -n /app/train.py'
for _ in $(seq 120); do
  kubectl -n "$NS" logs "$pod" | grep -q '"event": "restart"\|restart .*kind=process' && break
  sleep 5
done
kubectl -n "$NS" logs "$pod" | grep -q 'restart' || { echo "e2e.sh: no process restart seen" >&2; exit 1; }
if [[ "$TARGET" == jobset ]]; then
  kubectl -n "$NS" wait jobset/tierckpt-e2e --for=condition=Completed --timeout=1800s
else
  kubectl -n "$NS" wait pytorchjob/tierckpt-e2e --for=condition=Succeeded --timeout=1800s
fi
echo "e2e.sh: passed ($TARGET)"
