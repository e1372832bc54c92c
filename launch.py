def main() -> None:
    raise SystemExit("server not built yet")

if __name__ == "__main__":
    main()
