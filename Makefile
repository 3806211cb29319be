# kvscope: `make demo` (the main job) and `make test`. Both set up what they need.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
# Shared libraries Qt needs to render offscreen on a slim Debian.
APT_LIBS := libegl1 libgl1 libglib2.0-0 libfontconfig1 libfreetype6 fonts-dejavu-core \
            libxkbcommon0 libdbus-1-3

.PHONY: install test demo lint bench clean

install: $(STAMP)
	@$(PY) -m engine.cli model pull

$(STAMP): pyproject.toml constraints.txt
	@bash scripts/apt_deps.sh $(APT_LIBS)
	@test -x $(PY) || python3 -m venv .venv
	@# torch first, pinned: a plain `torch` requirement would pull the multi-GB CUDA build.
	$(PIP) install -q --disable-pip-version-check "torch==$$(grep -i '^torch==' constraints.txt | cut -d= -f3)"
	$(PIP) install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@rm -f .venv/.installed-* && touch $(STAMP)

test: install
	$(PY) -m ruff check engine inspector kernels tests scripts
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q tests

demo: install
	@bash scripts/demo.sh

lint: install
	$(PY) -m ruff check engine inspector kernels tests scripts

clean:
	rm -rf .venv test-artifacts demo-out
