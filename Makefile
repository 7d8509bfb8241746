# The two commands a person needs: `make test` (and, once the elastic core lands, `make demo`).
# Both run `make setup` first, which installs everything from this checkout's own files.
# The stack: the default is constraints.txt (TensorFlow 2.21 with Keras 3) in .venv; STACK=oldest
# is the oldest supported, TensorFlow 2.15.1 with Keras 2 (constraints-oldest.txt, in
# .venv-oldest), which `make test-oldest` checks.
STACK ?= default
ifeq ($(STACK),oldest)
VENV ?= .venv-oldest
CONSTRAINTS := constraints-oldest.txt
else
VENV ?= .venv
CONSTRAINTS := constraints.txt
endif
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
HOROVOD_PATCHES := $(wildcard elastic_allreduce/horovod_build/*.py elastic_allreduce/horovod_build/patches/*.patch)

.PHONY: setup lint test test-oldest oldest-suite test-known-bugs coverage demo chaos soak bench bench-quick bench-store bench-core clean \
	kube-build kube-up kube-down test-kube

setup: $(STAMP)

$(STAMP): scripts/setup.sh $(CONSTRAINTS) requirements-dev.txt pyproject.toml $(HOROVOD_PATCHES)
	VENV=$(VENV) CONSTRAINTS=$(CONSTRAINTS) bash scripts/setup.sh
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The suite runs on TEST_WORKERS pytest-xdist workers: a job test's processes mostly wait (on
# 2 cores one test used about a third of the CPU), so two at a time nearly halve the run
# (docs/contributing.md#running-the-tests). TEST_WORKERS=0: one process. --maxschedchunk 1: a
# worker is sent its next test when it is done with one, so neither is left with a queue of job
# tests while the other has nothing left to do.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/pytest -m "not known_bug" -n $(TEST_WORKERS) --maxschedchunk 1

# The suite of `make test` under coverage.py, every Python process it starts measured too
# (pyproject.toml's [tool.coverage.*]; docs/contributing.md#coverage): prints the report with the
# total and writes htmlcov/index.html. Reported, never enforced; exits with pytest's status.
# Measured processes run slower: each test may take 240 s instead of 120 before it times out.
coverage: setup
	$(BIN)/coverage erase
	@# coverage's own start-up hook in the venv: without it no subprocess would be measured.
	@$(BIN)/python -c 'import pathlib, sys, sysconfig; pth = pathlib.Path(sysconfig.get_path("purelib"), "a1_coverage.pth"); sys.exit(None if pth.is_file() else f"{pth} is missing: reinstall coverage (make clean setup)")'
	$(BIN)/coverage run -m pytest -m "not known_bug" --timeout 240; status=$$?; \
	$(BIN)/coverage combine --quiet && $(BIN)/coverage report && $(BIN)/coverage html; \
	exit $$status

# The oldest supported stack (constraints-oldest.txt: TensorFlow 2.15.1 with Keras 2, in its own
# .venv-oldest): lint, every test not marked slow, the compatibility suite (Horovod's own scripts),
# the demo and the core job tests (elastic recovery, snapshots, the Keras checks). About 25
# minutes on 2 cores (README, "Tested stacks").
OLDEST_JOB_TESTS := tests/compat tests/integration/test_demo.py tests/integration/test_elastic.py \
	tests/integration/test_snapshots.py tests/integration/test_keras_reduces.py

test-oldest:
	$(MAKE) STACK=oldest oldest-suite

oldest-suite: lint
	$(BIN)/pytest -m "not slow and not known_bug" -n $(TEST_WORKERS) --maxschedchunk 1
	$(BIN)/pytest -m "not known_bug" -n $(TEST_WORKERS) --maxschedchunk 1 $(OLDEST_JOB_TESTS)

# Tests that reproduce open bugs (each names its bug); they fail until the bug is fixed.
test-known-bugs: setup  # pytest exits 5 when no test is marked: no open bug is known
	$(BIN)/pytest -m known_bug || [ $$? -eq 5 ]

# Store latency and throughput figures (not a test): see bench/store_bench.py.
bench-store: setup
	$(BIN)/python bench/store_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The benchmark suite: elastic-run side by side with horovodrun and MPI (bench/README.md).
# Writes bench/results/latest.json, bench/results/latest.png and bench/RESULTS.md.
# `bench` takes about 45 minutes on 2 cores on TensorFlow 2.21 (30 on 2.15), `bench-quick` about 12.
bench: setup
	VENV=$(VENV) bash scripts/setup-bench.sh
	$(BIN)/python -m bench.suite

bench-quick: setup
	VENV=$(VENV) bash scripts/setup-bench.sh
	$(BIN)/python -m bench.suite --quick

# The elastic core's items only (throughput; crash, hang, scale-up), into bench/results/core/.
bench-core: setup
	$(BIN)/python -m bench.suite --items throughput,faults --out bench/results/core \
		--markdown bench/results/core/RESULTS.md

# The CNN digits example under elastic-run: 2 workers, a third joins, one is killed; then the
# final accuracy and the sample audit's verdict (about 1-2 minutes after set-up).
demo: setup
	$(BIN)/python examples/demo.py

# The CNN example without faults, then with 3 SIGKILLs and 2 joins: accuracies within one point,
# every digit exactly once per epoch (a few minutes on 2 cores).
chaos: setup
	$(BIN)/python examples/chaos.py

# The same job under a seeded random schedule of 100 faults of every kind (process kills and
# stops, leaves, joins, launcher takeover and adoption, etcd restarts, member kills, quorum loss,
# a cut link) on test hosts, after a clean run; writes bench/results/soak.json and the Soak
# section of bench/RESULTS.md (about 45 minutes on 2 cores; root, for network namespaces).
# Replay a schedule: `make soak SEED=...` (FAULTS=N for a shorter one).
soak: setup
	$(BIN)/python -m bench.soak $(if $(SEED),--seed $(SEED)) $(if $(FAULTS),--faults $(FAULTS))

# A private Kubernetes control plane for the tests (docs/kubernetes.md, "A real control plane in
# the tests"). `kube-build` compiles etcd, kube-apiserver, kube-scheduler, kube-controller-manager
# and kubectl, pinned by tools/kube/go.mod, into one binary (cold: about 6 minutes on 2 cores;
# Go's module and build caches make a rebuild quick, and make skips it when nothing changed).
GO ?= go
KUBE_BIN := build/kube/bin
KUBE_VERSION = $(shell sed -n 's/^[[:space:]]*k8s.io\/kubernetes v\([0-9.]*\)$$/\1/p' tools/kube/go.mod)
KUBE_VERSION_VARS = k8s.io/component-base/version k8s.io/client-go/pkg/version
KUBE_LDFLAGS = $(foreach pkg,$(KUBE_VERSION_VARS),-X $(pkg).gitVersion=v$(KUBE_VERSION) \
	-X $(pkg).gitMajor=$(word 1,$(subst ., ,$(KUBE_VERSION))) \
	-X $(pkg).gitMinor=$(word 2,$(subst ., ,$(KUBE_VERSION))) -X $(pkg).gitTreeState=clean)
# Nodes of the process kubelet that `kube-up` starts (0: the control plane only).
KUBE_NODES ?= 2

kube-build: $(KUBE_BIN)/kube-control-plane $(KUBE_BIN)/kubectl

$(KUBE_BIN)/kube-control-plane: tools/kube/go.mod tools/kube/go.sum $(wildcard tools/kube/*.go)
	@command -v $(GO) >/dev/null || { echo "kube-build needs Go ($(GO) is not on PATH)" >&2; exit 1; }
	mkdir -p $(KUBE_BIN)
	cd tools/kube && $(GO) build -trimpath -buildvcs=false -ldflags "$(KUBE_LDFLAGS)" \
		-o $(abspath $@) .

$(KUBE_BIN)/kubectl: $(KUBE_BIN)/kube-control-plane
	ln -sfn kube-control-plane $@

# Start a cluster in build/kube and leave it running (kubeconfig: build/kube/kubeconfig);
# prints its start-up time. `make kube-down` stops it and removes everything it made.
kube-up: setup kube-build
	$(BIN)/python -m tests.helpers.kube.cluster up --nodes $(KUBE_NODES)

kube-down: setup
	$(BIN)/python -m tests.helpers.kube.cluster down

# The tests against the real control plane (they skip, saying why, where it cannot be built).
test-kube: setup kube-build
	$(BIN)/pytest tests/kube
