package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/engramfs/engramfs/hints"
	"github.com/engramfs/engramfs/hints/client"
)

func init() {
	register("hint", "send a prefetch hint to a mount and wait for it", runHint)
}

func runHint(args []string) error {
	fl := newFlagSet("hint", "MOUNT [--decode] [--no-wait] LAYER [ROW ...]", `
Asks the mount at MOUNT to fetch ROWs of every table of LAYER into the page
cache: the command line face of .engramfs/control. With no ROW arguments,
rows are read from standard input, separated by white space. Hints are
prefill (best effort, may be dropped under load) unless --decode (served
first, never dropped, admitted to the hot tier).

Unless --no-wait, it then waits on the read barrier (read(2) on its own
control handle, which holds up no other process's hints), prints the status
line (pages named, resident, pinned, dropped, failed, and why pages failed)
and exits 1 if any page failed. A hint the mount rejects (a row out of
range, an unknown layer) exits 1 with the mount's reason.`)
	decode := fl.Bool("decode", false, "send a decode hint (this step's rows) instead of a prefill hint")
	noWait := fl.Bool("no-wait", false, "return once the hint is accepted, without waiting for the rows")
	pos, err := parseInterspersed(fl, args)
	if err != nil {
		return err
	}
	if len(pos) < 2 {
		return usagef("want MOUNT and LAYER, got %d arguments", len(pos))
	}
	layer, err := strconv.Atoi(pos[1])
	if err != nil || layer < 0 || layer > hints.MaxLayer {
		return usagef("LAYER %q: want a number from 0 to %d", pos[1], hints.MaxLayer)
	}
	var rows []uint64
	if len(pos) > 2 {
		rows, err = parseRows(strings.NewReader(strings.Join(pos[2:], " ")))
	} else {
		rows, err = parseRows(os.Stdin)
	}
	if err != nil {
		return err
	}
	h, err := client.Open(pos[0])
	if err != nil {
		return err
	}
	defer h.Close()
	if *decode {
		err = h.Decode(layer, rows)
	} else {
		err = h.Prefill(layer, rows)
	}
	if err != nil {
		return err
	}
	if *noWait {
		return nil
	}
	st, err := h.Barrier()
	line, jerr := json.Marshal(st)
	if jerr == nil {
		fmt.Println(string(line))
	}
	return err
}

// parseRows reads decimal row ids separated by white space.
func parseRows(r io.Reader) ([]uint64, error) {
	sc := bufio.NewScanner(r)
	sc.Split(bufio.ScanWords)
	var rows []uint64
	for sc.Scan() {
		v, err := strconv.ParseUint(sc.Text(), 10, 64)
		if err != nil {
			return nil, usagef("row %q: not a row number", sc.Text())
		}
		rows = append(rows, v)
	}
	return rows, sc.Err()
}

// parseInterspersed parses flags that may come between and after the
// positional arguments (`hint MOUNT --decode 3 1 2`), and returns the
// positional ones.
func parseInterspersed(fl *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fl.Parse(args); err != nil {
			return nil, err
		}
		if fl.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fl.Arg(0))
		args = fl.Args()[1:]
	}
}
