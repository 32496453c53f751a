package hints

import (
	"reflect"
	"testing"
)

// Add sums every count, whatever its name, and keeps the first reason.
func TestStatusAdd(t *testing.T) {
	var s Status
	one := Status{Error: "first"}
	v := reflect.ValueOf(&one).Elem()
	for i := range v.NumField() {
		if f := v.Field(i); f.Kind() == reflect.Uint64 {
			f.SetUint(uint64(i + 1))
		}
	}
	s.Add(one)
	two := one
	two.Error = "second"
	s.Add(two)
	sv := reflect.ValueOf(s)
	for i := range sv.NumField() {
		if f := sv.Field(i); f.Kind() == reflect.Uint64 && f.Uint() != 2*uint64(i+1) {
			t.Errorf("%s: %d, want %d", sv.Type().Field(i).Name, f.Uint(), 2*(i+1))
		}
	}
	if s.Error != "first" {
		t.Errorf("Error %q, want the first reason", s.Error)
	}
}
