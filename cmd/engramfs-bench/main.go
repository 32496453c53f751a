// Command engramfs-bench measures how engram rows are gathered today (pread
// and mmap of the shards) against engramfs, on the same data and the same
// disk: `engramfs-bench [bench] [flags]` is the full comparison,
// `engramfs-bench demo` a short one on a small model. It is a binary of its
// own so that the daemon does not link the bench's charts and statistics;
// `engramfs bench` and `engramfs demo` hand over to it.
//
// It runs the daemon from the engramfs binary next to it (or on PATH, or
// --engramfs): build both with `go build -o bin/ ./cmd/...`.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/engramfs/engramfs/internal/cli"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

// commands are the subcommands; the first is the default.
var commands = []struct {
	name, summary string
	run           func(args []string) error
}{
	{"bench", "measure engramfs against pread and mmap gathers and the disk", runBench},
	{"demo", "mount a small synthetic model and compare mmap with engramfs (under a minute)", runDemo},
}

func run(args []string, stderr io.Writer) int {
	name, cmd := commands[0].name, commands[0].run
	if len(args) > 0 {
		switch args[0] {
		case "help":
			usage(stderr)
			return 0
		case "bench", "demo":
			for _, c := range commands {
				if c.name == args[0] {
					name, cmd = c.name, c.run
				}
			}
			args = args[1:]
		}
	}
	if err := cmd(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "engramfs %s: %v\n", name, err)
		var ue usageError
		if errors.As(err, &ue) {
			return 2
		}
		return 1
	}
	return 0
}

func usage(w io.Writer) {
	fmt.Fprint(w, "Usage: engramfs-bench [command] [flags]   (engramfs bench, engramfs demo)\n\nCommands:\n")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-7s %s\n", c.name, c.summary)
	}
	fmt.Fprint(w, "\nWith no command: bench. Run 'engramfs-bench <command> --help' for its flags.\n")
}

// The command-line helpers both binaries share (internal/cli).
type usageError = cli.UsageError

var (
	usagef     = cli.Usagef
	newFlagSet = cli.NewFlagSet
)

// engramfsFlag registers --engramfs, the daemon binary to measure.
func engramfsFlag(fs *flag.FlagSet) *string {
	return fs.String("engramfs", "", "the engramfs `BINARY` whose mount command serves the engramfs paths (default: engramfs next to this program, else on PATH)")
}

// findEngramfs returns the daemon binary: flagged, or engramfs next to this
// executable, or on PATH.
func findEngramfs(flagged string) (string, error) {
	if flagged != "" {
		if _, err := os.Stat(flagged); err != nil {
			return "", usagef("--engramfs: %w", err)
		}
		return flagged, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	beside := filepath.Join(filepath.Dir(self), "engramfs")
	if _, err := os.Stat(beside); err == nil {
		return beside, nil
	}
	if p, err := exec.LookPath("engramfs"); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("no engramfs binary next to %s or on PATH: build both with `go build -o bin/ ./cmd/...`, or name it with --engramfs", self)
}
