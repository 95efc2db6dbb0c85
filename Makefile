# minibatch-engine: the two README commands are `make book` and `make test`.
# `make help` lists every target.
VENV    ?= .venv
PY      := $(VENV)/bin/python
# The torch the setup installs when .venv has none. The pin is the release the
# stored notebook outputs were produced with (nbval compares them); the package
# itself asks only for torch>=2.1 (pyproject.toml). TORCH_INDEX picks the wheel
# index: https://download.pytorch.org/whl/cpu gives the CPU-only build (a few
# hundred MB instead of the multi-GB CUDA build that PyPI serves on Linux).
#   make TORCH_INDEX=https://download.pytorch.org/whl/cpu test
#   make TORCH_SPEC=torch book          # the newest release instead of the pin
# A torch already in .venv is kept, whatever these say.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
STAMP   := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-installed
LAB_STAMP := $(VENV)/.lab-installed
CLIENTS_STAMP := $(VENV)/.clients-installed
# The venv's IPython kernel configuration (tools/ipython_kernel_config.py): it
# drops ipykernel's "running over TCP without encryption" warning, which every
# kernel nbval and nbconvert start on this machine's loopback would print.
KERNEL_CFG := $(VENV)/etc/ipython/ipython_kernel_config.py
# JupyterLab's settings overrides for this venv (tools/jupyterlab_overrides.json):
# never ask about, or fetch, "official Jupyter news", whose pop-up otherwise
# covers every view `make lab` opens; no check for newer JupyterLab versions.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
# The extras `make test` adds to the book's (pyproject.toml): pytest, nbval,
# playwright, transformers. TEST_EXTRAS=test,triton adds the Triton backend's
# CPU-interpreter tests (about 1 GB more).
TEST_EXTRAS ?= test
NOTEBOOKS := $(sort $(wildcard chapters/[0-9]*.ipynb)) book/simulator_validation.ipynb book/appendix_cpu_kernels.ipynb
JB      := $(VENV)/bin/jupyter-book
SANITIZE := tests/nbval_sanitize.cfg
# JupyterLab refuses to start as root (containers, cloud boxes) without this.
LAB_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
LAB_ARGS ?=

.PHONY: help install install-test book build test unit test-slow tests kernels nbval notebooks lab check-lab gpu-check clean
.PHONY: test-clients tests-and-notebooks nbval-alone
.PHONY: site-assets check-site site-check-if-browser

help:  ## this list
	@echo "make [target] [VAR=value ...]"
	@echo
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 24
	@echo
	@echo "variables: TORCH_SPEC ($(TORCH_SPEC)), TORCH_INDEX (a pip index URL for torch),"
	@echo "           LAB_ARGS (extra jupyter lab options), CHROMIUM (browser path, $(CHROMIUM))"

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || \
	  $(PY) -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e ".[book]"
	touch $(STAMP)
	@echo "installed: .venv is $$(du -sh $(VENV) | cut -f1) (torch $$(du -sh $$($(PY) -c 'import torch, os; print(os.path.dirname(torch.__file__))') | cut -f1) of it)"

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[book,$(TEST_EXTRAS)]"
	touch $(TEST_STAMP)
	@echo "installed the test extras: .venv is now $$(du -sh $(VENV) | cut -f1)"

$(KERNEL_CFG): tools/ipython_kernel_config.py | $(STAMP)
	install -D -m 644 $< $@

$(LAB_OVERRIDES): tools/jupyterlab_overrides.json | $(STAMP)
	install -D -m 644 $< $@

install: $(STAMP)  ## create .venv and install the package with the book extra (what building the site needs)

install-test: $(TEST_STAMP)  ## install the test extras too (pytest, nbval, playwright, transformers)

build: $(STAMP) site-assets  ## build the website into _build/html (warnings are errors)
	$(JB) build . --builder html -W -n --keep-going

book: build  ## build the website and print where it is
	@echo
	@echo "The book is built: open file://$(CURDIR)/_build/html/index.html"

# The C++ kernels compile once per machine (cached in ~/.cache/torch_extensions,
# minibatch_engine/attention/cpu_kernel.py): here, before the tests and chapters
# that use them, so the time it takes shows as a part of its own and no chapter's
# output carries the build message.
kernels: $(STAMP)  ## compile the C++ CPU kernels (once; later calls find them cached)
	@$(PY) -c "from minibatch_engine.attention.cpu_kernel import cpu_kernel_or_none; cpu_kernel_or_none()"

# UNIT_JOBS worker processes (pytest-xdist; 0: none, in pytest's own process),
# each given whole test files. Most tests run on one core, so two workers keep a
# two-core machine busy.
# The tests marked slow (a browser, JupyterLab, the base-install venv, the soak,
# the real clients guidellm and lm-eval, vllm-router) run apart in `make
# test-slow`; `make tests` (what `make test` runs) runs every test in one pytest
# session, the slow files first (tests/conftest.py orders them), so that the
# long ones start while the short ones fill the other worker.
UNIT_JOBS ?= 2
PYTEST_JOBS = $(PY) -m pytest -q -p no:cacheprovider --durations=10 -n $(UNIT_JOBS) --dist loadfile
unit: $(TEST_STAMP) kernels  ## unit, property and equivalence tests (pytest -m "not slow", UNIT_JOBS=2 workers)
	$(PYTEST_JOBS) -m "not slow" tests

test-slow: $(TEST_STAMP) kernels  ## the slow tests: browser, JupyterLab, base-install venv, soak, clients (pytest -m slow)
	$(PYTEST_JOBS) -m slow tests

tests: $(TEST_STAMP) kernels  ## every test, slow ones included, in one session (the slow files start first)
	$(PYTEST_JOBS) tests

# `make test`'s middle part: every test and every notebook but the NBVAL_ALONE
# ones, in ONE pytest session on UNIT_JOBS workers (nbval collects each notebook
# as a file of cells), so that neither the tests' last file nor the last notebook
# leaves a core idle while the other finishes. The slow test files come first
# (tests/conftest.py), then the long notebooks (NBVAL_FIRST), then the rest. Each
# notebook's kernel gets one PyTorch thread (OMP_NUM_THREADS), as the workers do.
tests-and-notebooks: $(TEST_STAMP) $(KERNEL_CFG) kernels  ## make test's middle part: every test and every notebook but the appendix, one session
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTEST_JOBS) --nbval --nbval-sanitize-with $(SANITIZE) \
	  $(foreach nb,$(NBVAL_FIRST),$(filter $(nb),$(NOTEBOOKS))) tests \
	  $(filter-out $(NBVAL_FIRST) $(NBVAL_ALONE),$(NOTEBOOKS))

# `make test`'s notebooks that time things with threads of their own, alone.
nbval-alone: $(TEST_STAMP) $(KERNEL_CFG) kernels  ## the notebooks that time with threads of their own (the CPU appendix), alone
	@sh tools/nbval_each.sh 1 "$(PY) -m pytest -q -p no:cacheprovider --nbval --nbval-sanitize-with $(SANITIZE)" \
	  -- $(filter $(NBVAL_ALONE),$(NOTEBOOKS))

# One pytest per notebook (tools/nbval_each.sh), NBVAL_JOBS at a time: each
# chapter's name shows as it starts and its time as it ends; every notebook runs
# even when one fails, a table of their times comes at the end, and the target
# fails naming the ones that failed. NBVAL_ALONE run after the others, one at a
# time: they time things on the wall clock with threads of their own.
# NBVAL_FIRST start first, the longest first (as `make nbval`'s table measured
# them), so that no long notebook starts last and runs on while a core idles.
NBVAL_JOBS ?= 2
NBVAL_ALONE := book/appendix_cpu_kernels.ipynb
NBVAL_FIRST := chapters/03_continuous_batching.ipynb chapters/08_serving_under_load.ipynb \
               chapters/12_many_engines.ipynb chapters/05_chunked_prefill.ipynb \
               chapters/13_fewer_bytes.ipynb chapters/09_speculative_decoding.ipynb \
               chapters/14_big_models.ipynb
NBVAL_PARALLEL = $(foreach nb,$(NBVAL_FIRST),$(filter $(nb),$(NOTEBOOKS))) \
                 $(filter-out $(NBVAL_FIRST) $(NBVAL_ALONE),$(NOTEBOOKS))
nbval: $(TEST_STAMP) $(KERNEL_CFG) kernels  ## re-run every chapter and compare with its stored outputs
	@sh tools/nbval_each.sh $(NBVAL_JOBS) "$(PY) -m pytest -q -p no:cacheprovider --nbval --nbval-sanitize-with $(SANITIZE)" \
	  $(filter-out $(NBVAL_ALONE),$(NBVAL_PARALLEL)) -- $(filter $(NBVAL_ALONE),$(NOTEBOOKS))

# `make test` runs its parts in turn, each a make target, and ends with a table
# of their times (up to the part that failed, when one fails). The setup part
# compiles the C++ kernels while pip and npm download (-j2): the kernels need
# only the base install, and a download leaves the cores idle.
TEST_PARTS := setup=-j2,install-test,site-assets,$(KERNEL_CFG),kernels \
              tests+nbval=tests-and-notebooks appendix=nbval-alone \
              build=build site-check=site-check-if-browser,SITE_BUILT=1
test:  ## setup (with the C++ kernels), every test and notebook, the appendix alone, the -W build, the browser check; then their times
	@status=0; times=""; start=$$(date +%s); \
	for part in $(TEST_PARTS); do \
	  t0=$$(date +%s); \
	  $(MAKE) --no-print-directory $$(echo "$${part#*=}" | tr , ' ') || status=$$?; \
	  times="$$times $${part%%=*}=$$(( $$(date +%s) - t0 ))"; \
	  [ $$status -eq 0 ] || break; \
	done; \
	echo; echo "make test: seconds per part$$([ $$status -eq 0 ] || echo ', up to the one that failed')"; \
	for t in $$times; do printf '  %-11s %5d\n' "$${t%%=*}" "$${t#*=}"; done; \
	printf '  %-11s %5d\n' total $$(( $$(date +%s) - start )); \
	exit $$status

# The `clients` extra is installed once (a stamp). Its tests (marked slow) also
# run in `make test-slow` once it is there; without it they skip, saying what to
# install.
$(CLIENTS_STAMP): $(TEST_STAMP)
	$(PY) -m pip install -e ".[book,$(TEST_EXTRAS),clients]"
	touch $(CLIENTS_STAMP)

CLIENT_TESTS := tests/engine/test_guidellm_client.py tests/engine/test_lm_eval_client.py
test-clients: $(CLIENTS_STAMP)  ## guidellm and lm-eval against a live `serve` (the clients extra, ~700 MB; ~3 min)
	$(PY) -m pytest -q -p no:cacheprovider --durations=5 $(CLIENT_TESTS)

notebooks: $(TEST_STAMP) $(KERNEL_CFG) kernels  ## re-execute every chapter in place (fresh stored outputs; MINIBATCH_RECOMPUTE=1 stores the sweeps again)
	for nb in $(NOTEBOOKS); do \
	  echo "executing $$nb"; \
	  MINIBATCH_RECOMPUTE=1 $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=1200 $$nb || exit 1; \
	done

# The `lab` extra is installed once (a stamp), not on every call.
$(LAB_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[lab]"
	touch $(LAB_STAMP)

# BookContentsManager (minibatch_engine/book/lab_server.py) fills in the glued
# numbers when Lab opens a chapter and writes the source back when it saves.
LAB_CONTENTS := minibatch_engine.book.lab_server.BookContentsManager
lab: $(LAB_STAMP) $(KERNEL_CFG) $(LAB_OVERRIDES)  ## JupyterLab on chapters/ (LAB_ARGS="--port 8889 --no-browser"; root adds --allow-root)
	$(VENV)/bin/jupyter lab $(LAB_ROOT) --ServerApp.contents_manager_class=$(LAB_CONTENTS) $(LAB_ARGS) chapters/

check-lab: $(LAB_STAMP) $(TEST_STAMP) $(LAB_OVERRIDES)  ## open every chapter in JupyterLab (headless Chromium): numbers filled in, not modified
	CHROMIUM=$(CHROMIUM) $(PY) tools/check_lab.py $(NOTEBOOKS)

# gpu-check installs nothing: it runs with .venv's Python when there is one, else
# with python3, which must have a CUDA build of torch (GPU_PY=... picks another).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:  ## CUDA tests + decode/prefill measurements into gpu_check.json (needs a GPU; < 5 min)
	$(GPU_PY) tools/gpu_check.py

clean:  ## remove _build (.venv, .venv-setupcheck and node_modules stay)
	rm -rf _build

# --- the website's browser libraries, served from the site itself (no CDN) ---
# MathJax 3, require.js and @jupyter-widgets/html-manager, pinned in package.json
# and package-lock.json; tools/offline_assets.py (a Sphinx extension, see
# _config.yml) copies them into _build/html/_static/npm/. npm ci runs only when
# the lock file is newer than the last install.
NODE_STAMP := node_modules/.site-assets-installed
CHROMIUM   ?= /usr/bin/chromium

$(NODE_STAMP): package.json package-lock.json
	@command -v npm >/dev/null || { echo "npm is needed for the site's MathJax and widget libraries (apt-get install -y npm)"; exit 1; }
	npm ci --no-audit --no-fund --ignore-scripts
	touch $@

site-assets: $(NODE_STAMP)  ## npm ci for the site's MathJax and widget libraries (once)

# Every page in headless Chromium with the network blocked: math typeset, images
# loaded, internal links and anchors resolve, widgets rendered, no JS errors, no
# code wider than its box at 1280 px. Screenshots go to _build/screenshots/.
check-site: build $(TEST_STAMP)  ## build, then open every page in headless Chromium, offline (CHROMIUM=path)
	CHROMIUM=$(CHROMIUM) $(PY) tools/check_site.py _build/html

# `make test` runs the browser check where a browser is installed (.ci/run installs one).
# SITE_BUILT=1 (make test, after its build part): check the site as built, no build first.
site-check-if-browser: $(if $(SITE_BUILT),,build) $(TEST_STAMP)  ## check-site when the browser (CHROMIUM) exists, else say it was skipped
	@if [ -x $(CHROMIUM) ]; then \
	  CHROMIUM=$(CHROMIUM) $(PY) tools/check_site.py _build/html; \
	else \
	  echo "check-site skipped: no browser at $(CHROMIUM) (apt-get install -y chromium, or CHROMIUM=/path/to/chrome)"; \
	fi
