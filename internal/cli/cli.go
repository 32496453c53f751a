// Package cli holds what the engramfs and engramfs-bench commands share:
// usage errors (exit status 2) and flag sets whose --help prints a synopsis
// and a description.
package cli

import (
	"flag"
	"fmt"
	"strings"
)

// UsageError is a mistake in the command line: the commands exit with
// status 2 on it (1 on any other error).
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// Usagef formats a UsageError.
func Usagef(format string, a ...any) error { return UsageError{fmt.Errorf(format, a...)} }

// NewFlagSet makes a flag set whose --help prints "Usage: engramfs NAME
// SYNOPSIS", the description and the flags, if any (the bench's commands
// too are documented as engramfs NAME).
func NewFlagSet(name, synopsis, description string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage: engramfs %s %s\n\n%s\n", name, synopsis, strings.TrimSpace(description))
		hasFlags := false
		fs.VisitAll(func(*flag.Flag) { hasFlags = true })
		if hasFlags {
			fmt.Fprint(w, "\nFlags:\n")
			fs.PrintDefaults()
		}
	}
	return fs
}
