package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// A run's binaries go when its tests end; those of a run that died before
// (its pid gone) go when the next run builds; a live run's stay.
func TestBinariesAreRemoved(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	deadDir := filepath.Join(os.TempDir(), fmt.Sprintf("%s%d-1", binPrefix, dead.Process.Pid))
	liveDir := filepath.Join(os.TempDir(), fmt.Sprintf("%s%d-2", binPrefix, os.Getppid()))
	for _, d := range []string{deadDir, liveDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	RemoveBinaries() // whatever an earlier test of this binary built
	sweepBinaries()
	if _, err := os.Stat(deadDir); !os.IsNotExist(err) {
		t.Errorf("a dead run's binaries: %v, want removed", err)
	}
	if _, err := os.Stat(liveDir); err != nil {
		t.Errorf("a live run's binaries: %v, want kept", err)
	}

	path := Command(t, "engramfs")
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}
	RemoveBinaries()
	if _, err := os.Stat(filepath.Dir(path)); !os.IsNotExist(err) {
		t.Fatalf("after RemoveBinaries: %v, want the directory gone", err)
	}
}
