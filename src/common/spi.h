/*-------------------------------------------------------------------------
 *
 * spi.h
 *	  Running the extension's own SQL (spi.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_SPI_H
#define IDEM_COMMON_SPI_H

/* A fixed SQL statement of a subsystem, prepared once per backend. */
typedef struct IdemStatement
{
	const char *sql;
	int			nargs;
	Oid			argtypes[10];
} IdemStatement;

struct _SPI_plan;
extern int	idem_pin_search_path(void);
extern struct _SPI_plan *idem_statement_plan(const IdemStatement *st, struct _SPI_plan **slot);
extern uint64 idem_statement_exec(const IdemStatement *st, struct _SPI_plan **slot, Datum *values,
								  const char *nulls, int expected);
extern Datum idem_spi_col(uint64 row, int col, bool *isnull);
extern void idem_rethrow_without_sql(MemoryContext cxt, const char *sql) pg_attribute_noreturn();
extern void idem_spi_exec(const char *sql, int nargs, Oid *types, Datum *values, int expected);

#endif							/* IDEM_COMMON_SPI_H */
