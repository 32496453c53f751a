package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/engramfs/engramfs/internal/stats"
)

const docPath = "../../../docs/operations.md"

// TestDocsTableIsGenerated fails when the stats table committed in
// docs/operations.md is not what `go generate ./internal/stats` writes.
func TestDocsTableIsGenerated(t *testing.T) {
	doc, err := os.ReadFile(docPath)
	if err != nil {
		t.Fatal(err)
	}
	want, err := splice(doc, table(stats.Fields))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(doc, want) {
		t.Fatalf("the stats table in docs/operations.md is stale: run `go generate ./internal/stats` and commit the result")
	}
	for _, f := range stats.Fields {
		if !bytes.Contains(doc, []byte("| `"+f.Name+"` |")) {
			t.Errorf("docs/operations.md has no row for %s", f.Name)
		}
	}
}

func TestGenerateRewritesOnlyTheTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "doc.md")
	before, after := "# Title\n\ntext before\n", "text after\n"
	stale := before + beginMarker + "\n| old | table |\n" + endMarker + "\n" + after
	if err := os.WriteFile(path, []byte(stale), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := generate(path); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(path)
	want := before + beginMarker + "\n" + table(stats.Fields) + endMarker + "\n" + after
	if string(got) != want {
		t.Fatalf("generate wrote\n%s\nwant\n%s", got, want)
	}
	for _, bad := range []string{"no markers\n", endMarker + "\n" + beginMarker + "\n", beginMarker + "\n" + beginMarker + "\n" + endMarker + "\n"} {
		if _, err := splice([]byte(bad), "x\n"); err == nil {
			t.Errorf("splice accepted %q", bad)
		}
	}
	if !strings.Contains(table([]stats.Field{{Name: "a", Meaning: "x | y.", Group: "G"}}), `x \| y.`) {
		t.Errorf("a | in a meaning is not escaped")
	}
}
