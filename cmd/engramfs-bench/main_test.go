package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFindEngramfs(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	// The test binary has no engramfs beside it (its directory is go test's own).
	if _, err := findEngramfs(""); err == nil || !strings.Contains(err.Error(), "go build -o bin/ ./cmd/...") {
		t.Errorf("no engramfs: %v, want the build command", err)
	}
	var ue usageError
	if _, err := findEngramfs(filepath.Join(t.TempDir(), "nope")); !errors.As(err, &ue) {
		t.Errorf("a missing --engramfs: %v, want a usage error", err)
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "engramfs")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := findEngramfs(p); err != nil || got != p {
		t.Errorf("--engramfs %s: %q, %v", p, got, err)
	}
	t.Setenv("PATH", dir)
	if got, err := findEngramfs(""); err != nil || got != p {
		t.Errorf("engramfs on PATH: %q, %v", got, err)
	}
}

func TestRunUsage(t *testing.T) {
	var b strings.Builder
	if code := run([]string{"help"}, &b); code != 0 || !strings.Contains(b.String(), "demo") {
		t.Errorf("help: %d\n%s", code, b.String())
	}
	b.Reset()
	if code := run([]string{"bench", "extra"}, &b); code != 2 || !strings.Contains(b.String(), "takes no arguments") {
		t.Errorf("bench extra: %d, want 2\n%s", code, b.String())
	}
}

// TestRemoveModelsFlag: --remove-models removes what a run kept under
// --model-dir, says so, and exits without measuring anything.
func TestRemoveModelsFlag(t *testing.T) {
	root := filepath.Join(t.TempDir(), "models")
	dir := filepath.Join(root, "big-4096")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "model-00001-of-00001.safetensors"), make([]byte, 3000), 0o644); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if code := run([]string{"bench", "--remove-models", "--model-dir", root, "--engramfs", "/nonexistent"}, &b); code != 0 {
		t.Fatalf("exit %d: %s", code, b.String())
	}
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Errorf("%s still there: %v", root, err)
	}
}
