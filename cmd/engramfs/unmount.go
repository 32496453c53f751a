package main

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

func init() {
	register("unmount", "unmount an engramfs mount (live or dead)", runUnmount)
}

func runUnmount(args []string) error {
	fl := newFlagSet("unmount", "MOUNTPOINT", `
Unmounts MOUNTPOINT. A mount that a reader still uses (EBUSY), or whose daemon
died (the mountpoint answers "transport endpoint is not connected"), is
detached lazily instead: it disappears from the tree at once and the kernel
frees it when the last user lets go.`)
	if err := fl.Parse(args); err != nil {
		return err
	}
	if fl.NArg() != 1 {
		return usagef("want MOUNTPOINT, got %d arguments", fl.NArg())
	}
	mp := fl.Arg(0)
	err := unix.Unmount(mp, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(mp, unix.MNT_DETACH)
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EINVAL):
		return fmt.Errorf("%s: not a mount point", mp)
	default:
		return fmt.Errorf("%s: %w", mp, err)
	}
}
