package bench

import (
	"time"

	"golang.org/x/sys/unix"
)

// selfCPU is this process's CPU time (user + system, all threads).
func selfCPU() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ownCPU is the CPU time of this process and of its children that have
// exited (the daemons the bench started and stopped).
func ownCPU() time.Duration {
	var self, kids unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &self) != nil || unix.Getrusage(unix.RUSAGE_CHILDREN, &kids) != nil {
		return 0
	}
	return time.Duration(self.Utime.Nano() + self.Stime.Nano() + kids.Utime.Nano() + kids.Stime.Nano())
}
