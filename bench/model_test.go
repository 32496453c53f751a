package bench

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRemoveModels: the models a run generated go, with their sizes; a
// directory holding anything the bench did not write stays, named in the
// error, and so does the root then.
func TestRemoveModels(t *testing.T) {
	root := filepath.Join(t.TempDir(), "models")
	var dirs []string
	for _, name := range []string{GeometryBig, GeometryFlash} {
		g, _ := NewGeometry(name, 1, 512)
		dir, generated, err := EnsureModel(context.Background(), root, g, 1, nil)
		if err != nil || !generated {
			t.Fatalf("%s: %v (generated %v)", name, err, generated)
		}
		dirs = append(dirs, dir)
	}
	mine := filepath.Join(root, "notes")
	if err := os.MkdirAll(mine, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mine, "todo.txt"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	removed, err := RemoveModels(root)
	if err == nil || !strings.Contains(err.Error(), "todo.txt") {
		t.Errorf("a directory of someone else's: %v, want it named", err)
	}
	if len(removed) != 2 || removed[0].Bytes <= 0 {
		t.Errorf("removed %+v, want both models with their sizes", removed)
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("%s is still there", d)
		}
	}
	if _, err := os.Stat(filepath.Join(mine, "todo.txt")); err != nil {
		t.Errorf("someone else's file went: %v", err)
	}
	if err := os.RemoveAll(mine); err != nil {
		t.Fatal(err)
	}
	if removed, err := RemoveModels(root); err != nil || len(removed) != 0 {
		t.Errorf("nothing left: %+v, %v", removed, err)
	}
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Errorf("the empty root is still there: %v", err)
	}
	if removed, err := RemoveModels(root); err != nil || removed != nil {
		t.Errorf("no root: %+v, %v", removed, err)
	}
}
