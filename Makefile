# minibatch-engine: the two README commands are `make book` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
# torch is pinned here only for the setup: on a machine with a local CPU wheel of
# 2.13.0 it installs in seconds; elsewhere pip fetches the platform's build of that
# release (CUDA on Linux). Override with `make TORCH_SPEC=torch ...` to take the newest.
TORCH_SPEC ?= torch==2.13.0
STAMP   := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard chapters/[0-9]*.ipynb))
JB      := $(VENV)/bin/jupyter-book
SANITIZE := tests/nbval_sanitize.cfg

.PHONY: help install book test unit nbval build notebooks lab bench gpu-check clean
.PHONY: site-assets check-site site-check-if-browser

help:
	@echo "make book       build the website into _build/html (creates .venv if missing)"
	@echo "make test       unit tests, nbval over every chapter, the -W book build"
	@echo "make notebooks  re-execute every chapter in place (fresh stored outputs)"
	@echo "make lab        open the chapters in JupyterLab"
	@echo "make gpu-check  the CUDA checks (needs a GPU)"
	@echo "make check-site build, then open every page in headless Chromium, offline"

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[book,test]"
	touch $(STAMP)

install: $(STAMP)

build: $(STAMP) site-assets
	$(JB) build . --builder html -W -n --keep-going

book: build
	@echo
	@echo "The book is built: open file://$(CURDIR)/_build/html/index.html"

unit: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

nbval: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --nbval --nbval-sanitize-with $(SANITIZE) $(NOTEBOOKS)

test: unit nbval build site-check-if-browser

notebooks: $(STAMP)
	for nb in $(NOTEBOOKS); do \
	  $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.record_timing=False --ExecutePreprocessor.timeout=1200 $$nb || exit 1; \
	done

lab: $(STAMP)
	$(PY) -m pip install -q "jupyterlab>=4"
	$(VENV)/bin/jupyter lab chapters/

gpu-check: $(STAMP)
	$(PY) -m pytest -q -m cuda tests

clean:
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

site-assets: $(NODE_STAMP)

# Every page in headless Chromium with the network blocked: math typeset, images
# loaded, internal links and anchors resolve, widgets rendered, no JS errors.
# Screenshots go to _build/screenshots/.
check-site: build
	CHROMIUM=$(CHROMIUM) $(PY) tools/check_site.py _build/html

# `make test` runs the browser check where a browser is installed (.ci/run installs one).
site-check-if-browser: build
	@if [ -x $(CHROMIUM) ]; then \
	  CHROMIUM=$(CHROMIUM) $(PY) tools/check_site.py _build/html; \
	else \
	  echo "check-site skipped: no browser at $(CHROMIUM) (apt-get install -y chromium)"; \
	fi
