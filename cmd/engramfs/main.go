// Command engramfs mounts the engram tables of a model directory as
// row-granular, read-only files, and holds the tools around that mount.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/engramfs/engramfs/internal/cli"
	// Refuses, with a message, a descriptor limit too low to start, before
	// go-fuse's init panics on it.
	_ "github.com/engramfs/engramfs/internal/nofile"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type command struct {
	summary string
	run     func(args []string) error
}

var commands = map[string]command{}

func register(name, summary string, run func(args []string) error) {
	commands[name] = command{summary: summary, run: run}
}

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

func run(args []string, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "engramfs: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	if err := cmd.run(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		var ue usageError
		if errors.As(err, &ue) {
			fmt.Fprintf(stderr, "engramfs %s: %v\n", args[0], err)
			return 2
		}
		fmt.Fprintf(stderr, "engramfs %s: %v\n", args[0], err)
		return 1
	}
	return 0
}

func usage(w io.Writer) {
	fmt.Fprint(w, `engramfs serves the engram tables of a model directory (n-gram hash embedding
tables in safetensors shards) as a read-only FUSE tree of row-granular files:
a page fault costs one page of backing I/O, hot rows stay pinned in the page
cache, and hinted rows are pushed into it before the reader asks.

Usage: engramfs <command> [flags] [args]

Commands:
`)
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-13s %s\n", n, commands[n].summary)
	}
	fmt.Fprint(w, "\nRun 'engramfs <command> --help' for the flags of a command.\n")
}

// The command-line helpers both binaries share (internal/cli).
type usageError = cli.UsageError

var (
	usagef     = cli.Usagef
	newFlagSet = cli.NewFlagSet
)

// logFlags are the logging flags every long-running command takes.
type logFlags struct {
	level  string
	format string
}

func (l *logFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&l.level, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&l.format, "log-format", "console", "log format: console or json")
}

func (l *logFlags) logger() (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(l.level)
	if err != nil {
		return nil, usagef("--log-level %q: want debug, info, warn or error", l.level)
	}
	var cfg zap.Config
	switch l.format {
	case "console":
		cfg = zap.NewDevelopmentConfig()
		cfg.DisableStacktrace = true
		cfg.DisableCaller = true
	case "json":
		cfg = zap.NewProductionConfig()
	default:
		return nil, usagef("--log-format %q: want console or json", l.format)
	}
	cfg.Level = zap.NewAtomicLevelAt(lvl)
	cfg.Development = false
	return cfg.Build()
}

func init() {
	register("version", "print the version", func(args []string) error {
		fs := newFlagSet("version", "", "Prints the engramfs version.")
		if err := fs.Parse(args); err != nil {
			return err
		}
		fmt.Println("engramfs", version)
		return nil
	})
}
