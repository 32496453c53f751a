package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// benchBinary is the program `engramfs bench` and `engramfs demo` hand over
// to: the bench links charts, statistics and PDF code the daemon has no use
// for, so it ships as a binary of its own.
const benchBinary = "engramfs-bench"

func init() {
	register("bench", "measure engramfs against pread and mmap gathers and the disk (runs "+benchBinary+")", handOver("bench"))
	register("demo", "mount a small synthetic model and compare mmap with engramfs, under a minute (runs "+benchBinary+")", handOver("demo"))
}

// handOver returns a command that replaces this process with
// `engramfs-bench SUB --engramfs THIS [args]`: the bench found next to this
// executable, else on PATH, told to run this executable's daemon.
func handOver(sub string) func(args []string) error {
	return func(args []string) error {
		self, err := os.Executable()
		if err != nil {
			return err
		}
		bin, err := findBench(self)
		if err != nil {
			return err
		}
		argv := append([]string{bin, sub, "--engramfs", self}, args...)
		if err := syscall.Exec(bin, argv, os.Environ()); err != nil {
			return fmt.Errorf("exec %s: %w", bin, err)
		}
		return nil // not reached
	}
}

// findBench looks for engramfs-bench next to self, then on PATH.
func findBench(self string) (string, error) {
	beside := filepath.Join(filepath.Dir(self), benchBinary)
	if _, err := os.Stat(beside); err == nil {
		return beside, nil
	}
	if p, err := exec.LookPath(benchBinary); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("%s is not next to %s nor on PATH: the bench is a binary of its own; build both with `go build -o bin/ ./cmd/...` and run bin/engramfs", benchBinary, self)
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
